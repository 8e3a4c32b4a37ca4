"""Which failed calls are worth another try (as the SDK judges them), how long to
wait, and what a failure that ends the run says."""

from __future__ import annotations

import email.utils
import logging
import time
import urllib.parse
from typing import Any

import anthropic
import httpx2
import tenacity

from agentruns.errors import one_line
from agentruns.models.anthropic.stream import IncompleteStream

log = logging.getLogger(__name__)

MAX_RETRY_AFTER_S = 60.0  # a longer retry-after is waited out only this long per try
_TRANSIENT_STATUS = frozenset({408, 409, 429})
_TRANSIENT_STREAM_ERRORS = frozenset(
    {"overloaded_error", "api_error", "rate_limit_error", "timeout_error"}
)


# How much of what the server said an error keeps (a proxy's 502 may be a whole HTML page).
_DETAIL_LENGTH = 1000


def is_transient(exc: BaseException) -> bool:
    """Whether the SDK would retry this (its retries are off: ours keep its policy),
    or it is a stream cut short. As the SDK does, the ``__cause__`` chain counts
    (a middleware's error raised from a retryable one), and so does the server's
    ``x-should-retry`` header."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, _RETRYABLE):
            return True
        if isinstance(current, anthropic.APIStatusError):
            if current.status_code < 400:  # an error event inside a 200 stream
                return current.type in _TRANSIENT_STREAM_ERRORS
            said = current.response.headers.get("x-should-retry")
            if said in ("true", "false"):
                return said == "true"
            return current.status_code in _TRANSIENT_STATUS or current.status_code >= 500
        if isinstance(current, anthropic.APIConnectionError | httpx2.TransportError):
            return True
        current = current.__cause__
    return False


# What a client's middleware raises to ask for a retry, and a stream cut short.
_RETRYABLE = (anthropic.RetryableError, IncompleteStream)


def retry_after(exc: BaseException) -> float | None:
    if not isinstance(exc, anthropic.APIStatusError) or exc.status_code < 400:
        return None
    headers = exc.response.headers
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return float(value) * scale
        except ValueError:
            pass
        if name == "retry-after" and (date := email.utils.parsedate_tz(value)) is not None:
            return float(email.utils.mktime_tz(date)) - time.time()
    return None


def log_retry(state: tenacity.RetryCallState, run_id: str | None = None) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    wait = state.next_action.sleep if state.next_action is not None else 0.0
    said = one_line(str(exc), _DETAIL_LENGTH)
    of = f" of run {run_id}" if run_id else ""
    log.warning(
        "Anthropic call%s failed (try %d): %s; retrying in %.2fs",
        of,
        state.attempt_number,
        said,
        wait,
    )


def describe(exc: BaseException, model: str, client: anthropic.Anthropic, tries: int) -> str:
    after = f" after {tries} tries" if tries > 1 else ""
    if isinstance(exc, anthropic.APIStatusError):
        detail = one_line(exc.api_message or str(exc), _DETAIL_LENGTH)
        where = "in the response stream" if exc.status_code < 400 else f"HTTP {exc.status_code}"
        hint = {
            401: "; check ANTHROPIC_API_KEY",
            403: "; the API key may not have access to this model or feature",
            404: f"; check the model id {model!r}",
            413: "; the request is too large, shorten the transcript or tool results",
        }.get(exc.status_code, "")
        return f"Anthropic API error{after}: {exc.type or 'error'} ({where}): {detail}{hint}"
    if isinstance(exc, anthropic.APITimeoutError):
        return f"the Anthropic API at {_shown(client.base_url)} timed out{after}"
    if isinstance(exc, anthropic.APIConnectionError | httpx2.TransportError):
        return f"could not reach the Anthropic API at {_shown(client.base_url)}{after}: {exc}"
    if isinstance(exc, IncompleteStream):
        return f"the Anthropic response stream was cut off{after}: {exc}"
    hint = "; set ANTHROPIC_API_KEY" if "authentication" in str(exc).lower() else ""
    said = one_line(str(exc), _DETAIL_LENGTH)
    return f"the Anthropic call failed: {type(exc).__name__}: {said}{hint}"


def _shown(url: Any) -> str:
    """A base URL fit for an error message (stored with the run): no user, password
    or query, where a gateway may keep its credentials."""
    parts = urllib.parse.urlsplit(str(url))
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))
