"""The run types: what a run, a step and a checkpoint look like (SPEC §2)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import to_json

from agentruns.errors import shortened


def utcnow() -> datetime:
    return datetime.now(UTC)


class RunStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    WAITING = "waiting"
    INTERRUPTED = "interrupted"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    FINAL: ClassVar[frozenset[RunStatus]]

    @property
    def is_final(self) -> bool:
        return self in _FINAL


_FINAL = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED})
RunStatus.FINAL = _FINAL


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Usage(_Model):
    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            cache_creation_input_tokens=self.cache_creation_input_tokens
            + other.cache_creation_input_tokens,
            cache_read_input_tokens=self.cache_read_input_tokens + other.cache_read_input_tokens,
        )

    @property
    def total_tokens(self) -> int:
        """Every input token the model read, cached or not, plus its output.

        Anthropic's ``input_tokens`` leaves out cache reads and writes; a budget
        on context must count them.
        """
        return (
            self.input_tokens
            + self.cache_creation_input_tokens
            + self.cache_read_input_tokens
            + self.output_tokens
        )


class Budget(_Model):
    max_steps: int = Field(default=25, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    # Finite: a budget is stored as JSON, which has no infinity.
    timeout_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)

    @field_validator("max_steps", "max_tokens", "timeout_s", mode="before")
    @classmethod
    def _not_a_bool(cls, value: Any) -> Any:
        # pydantic takes True for 1 (`--budget '{"max_steps": true}'` was one step).
        if isinstance(value, bool):
            raise ValueError(f"a limit is a number, not {str(value).lower()}")
        return value


def json_problem(value: Any) -> str | None:
    """Why the store cannot keep ``value`` as JSON, or None: a NaN, a set, a lone
    surrogate, or nesting deeper than pydantic serializes (254 levels), which every
    read of a run or step that holds it would then fail on. Both what a trigger
    carries and what a model's reply asks a tool are held to it."""
    try:
        to_json(value)  # first: it refuses deep nesting without recursing in Python
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode()
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


def _check_json(value: Any) -> Any:
    problem = json_problem(value)
    if problem is not None:
        raise ValueError(f"payload is not JSON: {problem}")
    return value


def with_text_keys(value: Any) -> Any:
    """``value`` with its dicts' keys as JSON spells them (and its tuples as lists);
    ``ValueError`` if two keys of a dict would then be one ({1: .., "1": ..}), which
    JSON would keep only the last of."""
    if isinstance(value, dict):
        spelled: dict[str, Any] = {}
        given: dict[str, Any] = {}
        for key, item in value.items():
            text = key if isinstance(key, str) else json.dumps(key)
            if text in spelled:
                raise ValueError(
                    f"payload is not JSON: the keys {given[text]!r} and {key!r} of a dict"
                    f" are both {text!r} in JSON"
                )
            spelled[text], given[text] = with_text_keys(item), key
        return spelled
    if isinstance(value, list | tuple):
        return [with_text_keys(item) for item in value]
    return value


def keys_not_text(value: Any) -> bool:
    """Has a dict in ``value`` a key that is not text? (For a value ``json_problem``
    passed: its nesting is bounded.)"""
    containers = [value]
    while containers:
        found = containers.pop()
        if isinstance(found, dict):
            if not all(isinstance(key, str) for key in found):
                return True
            containers.extend(v for v in found.values() if isinstance(v, dict | list | tuple))
        elif isinstance(found, list | tuple):
            containers.extend(v for v in found if isinstance(v, dict | list | tuple))
    return False


def _check_text(value: Any) -> Any:
    """Text must be UTF-8 to be stored: a lone surrogate (from undecodable bytes) is not."""
    texts = [value] if isinstance(value, str) else [*value, *value.values()] if value else []
    for text in texts:
        if not is_utf8(text):
            raise ValueError(f"{text!r} is not valid UTF-8 text")
    return value


def is_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def is_storable_key(text: str) -> bool:
    """Can every store hold ``text`` in a key column (an id, a name)? UTF-8, and no
    NUL, which Postgres text cannot hold (SQLite can: one answer for both)."""
    return "\x00" not in text and is_utf8(text)


def storable_text(text: str) -> str:
    """``text`` as UTF-8 can hold it: a lone surrogate (from undecodable bytes, e.g. a
    file name in an exception's message) becomes its ``\\udcxx`` escape."""
    if is_utf8(text):
        return text
    return text.encode("utf-8", "backslashreplace").decode()


class TriggerEnvelope(_Model):
    source: str
    trigger: str
    payload: Any = None
    id: str | None = None
    keys: dict[str, str] = Field(default_factory=dict)
    thread: str | None = None
    received_at: datetime = Field(default_factory=utcnow)

    _check_payload = field_validator("payload")(classmethod(lambda cls, v: _check_json(v)))
    _check_texts = field_validator("source", "trigger", "id", "keys", "thread")(
        classmethod(lambda cls, v: _check_text(v))
    )

    def first_message(self) -> dict[str, Any]:
        """The user message a new run starts from: source, trigger and payload only,
        as the seed renders it (in that order, the payload's keys as they came, text
        as it is: a model reads it; escaped, each character outside ASCII costs it
        more tokens)."""
        body = {"source": self.source, "trigger": self.trigger, "payload": self.payload}
        return {"role": "user", "content": json.dumps(body, indent=2, ensure_ascii=False)}


class WaitPoint(_Model):
    kind: Literal["approval"] = "approval"
    approval_id: str
    tool_name: str
    input: Any
    expires_at: datetime
    token_id: str
    notified_at: datetime | None = None
    tool_call_id: str | None = None


# How much of an error's message a run keeps: what caused it may be quoted whole
# (a proxy's HTML page of 700 KB as a model error, a tool's huge exception text).
ERROR_MESSAGE_LENGTH = 4000


class RunError(_Model):
    code: str
    message: str

    @field_validator("message")
    @classmethod
    def _storable(cls, value: str) -> str:
        # What an error says often quotes what caused it: the error must be stored anyway.
        # (Escaped first: an escape is 6 characters, and a re-read must change nothing.)
        return shortened(storable_text(value), ERROR_MESSAGE_LENGTH)


class Claim(_Model):
    owner: str
    expires_at: datetime


class Run(_Model):
    id: str
    agent: str
    status: RunStatus
    trigger: TriggerEnvelope
    idempotency_key: str | None = None
    concurrency_key: str | None = None
    thread: str | None = None
    output: str | None = None
    error: RunError | None = None
    usage: Usage = Field(default_factory=Usage)
    steps_used: int = 0
    waiting: WaitPoint | None = None
    claim: Claim | None = None
    cancel_requested: bool = False
    budget: Budget | None = None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None


StepKind = Literal["llm", "tool", "wait"]


class Step(_Model):
    run_id: str
    index: int
    kind: StepKind
    name: str | None = None
    input: Any = None
    output: Any = None
    error: Any = None
    started_at: datetime
    finished_at: datetime


class Checkpoint(_Model):
    run_id: str
    step_index: int
    messages: list[dict[str, Any]]
    finish_reason: str | None = None
    state: dict[str, Any] | None = None
    created_at: datetime
