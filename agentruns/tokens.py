"""Resume tokens: signed, expiring, single-use, bound to one exact tool call.

A token is ``base64url(claims).base64url(hmac_sha256(secret, claims))``;
only its id is stored, so a database leak does not leak usable tokens.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from agentruns.errors import InvalidTokenError
from agentruns.runs import WaitPoint, utcnow


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def call_hash(tool_name: str, tool_input: Any) -> str:
    """A hash of the tool name and its exact input, in canonical JSON."""
    canonical = json.dumps(tool_input, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return _b64(hashlib.sha256(f"{tool_name}\0{canonical}".encode()).digest())


@dataclass(frozen=True)
class TokenClaims:
    run_id: str
    approval_id: str
    token_id: str
    expires_at: datetime
    call_hash: str


def mint(secret: str, run_id: str, wait: WaitPoint) -> str:
    claims = {
        "r": run_id,
        "a": wait.approval_id,
        "t": wait.token_id,
        # Whole seconds, rounded up: the token never runs out before its wait point,
        # whose own expiry (to the microsecond) resume checks too.
        "e": math.ceil(wait.expires_at.timestamp()),
        "h": call_hash(wait.tool_name, wait.input),
    }
    body = _b64(json.dumps(claims, separators=(",", ":")).encode())
    return f"{body}.{_sign(secret, body)}"


def _sign(secret: str, body: str) -> str:
    return _b64(hmac.new(secret.encode(), body.encode(), hashlib.sha256).digest())


def verify(secret: str, token: str, now: datetime | None = None) -> TokenClaims:
    """Check shape, signature and expiry; raises ``InvalidTokenError`` with the reason.
    Spaces and line ends around it are no part of it (a token pasted by a bot or read
    from a file brings them; one failed as ``bad_signature``, said to be altered)."""
    if isinstance(token, str):
        token = token.strip(" \t\r\n")
    if not isinstance(token, str) or token.count(".") != 1:
        raise InvalidTokenError("malformed")
    body, signature = token.split(".")
    try:  # unsigned yet: whatever it holds is only "malformed"
        raw = json.loads(_unb64(body))
        claims = TokenClaims(
            run_id=str(raw["r"]),
            approval_id=str(raw["a"]),
            token_id=str(raw["t"]),
            expires_at=datetime.fromtimestamp(int(raw["e"]), UTC),
            call_hash=str(raw["h"]),
        )
        _unb64(signature)
    except (ValueError, KeyError, TypeError, OverflowError, OSError, RecursionError):
        # (binascii.Error is a ValueError.) OSError and OverflowError: an expiry no
        # date can hold; RecursionError: JSON nested deeper than the parser goes.
        raise InvalidTokenError("malformed") from None
    if not hmac.compare_digest(signature, _sign(secret, body)):
        raise InvalidTokenError("bad_signature")
    if claims.expires_at <= (now or utcnow()):
        raise InvalidTokenError("expired")
    return claims


def matches(claims: TokenClaims, run_id: str, wait: WaitPoint | None) -> bool:
    """Is this token for the wait point the run is waiting on right now?"""
    return (
        wait is not None
        and claims.run_id == run_id
        and claims.approval_id == wait.approval_id
        and claims.token_id == wait.token_id
        and claims.call_hash == call_hash(wait.tool_name, wait.input)
    )
