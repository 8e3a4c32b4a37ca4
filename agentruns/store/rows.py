"""Rows to run types: how a stored run, step or write result reads back as pydantic models."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any, TypeVar

from pydantic import BaseModel
from sqlalchemy.engine import RowMapping

from agentruns.errors import InvalidCheckpointError
from agentruns.runs import (
    Budget,
    Claim,
    Run,
    RunError,
    RunStatus,
    Step,
    TriggerEnvelope,
    Usage,
    WaitPoint,
)
from agentruns.store.base import Commit

M = TypeVar("M", bound=BaseModel)
log = logging.getLogger("agentruns")


def aware(value: datetime | None) -> datetime | None:
    # SQLite hands back naive datetimes; everything we store is UTC.
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


# What a JSON column damaged outside agentruns reads as (see ``read_run``).
UNREADABLE_TRIGGER = TriggerEnvelope(source="unreadable", trigger="unreadable", payload=None)
_UNREADABLE_ERROR = RunError(code="invalid_checkpoint", message="the stored error cannot be read")


def _json(
    row: RowMapping | dict[str, Any],
    column: str,
    model: type[M],
    problems: list[str],
    unreadable: M | None = None,
) -> M | None:
    """A JSON column as its model: None if empty (but the trigger, never empty), and
    ``unreadable`` if its model refuses it, the problem noted in ``problems``."""
    value = row[column]
    if not value and column != "trigger":
        return None
    try:
        return model.model_validate(value)
    except ValueError as exc:  # pydantic's ValidationError is one
        problems.append(f"its {column} is not a valid {model.__name__} ({first_problem(exc)})")
        return unreadable


def first_problem(exc: Exception) -> str:
    """What a value read back failed on: pydantic's first error, where it is; else
    the exception's first line."""
    errors = getattr(exc, "errors", None)
    if callable(errors) and errors():
        first = errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"{where}: {first['msg']}" if where else str(first["msg"])
    return str(exc).splitlines()[0]


def read_run(row: RowMapping | dict[str, Any]) -> tuple[Run, str | None]:
    """The run a row holds, and what of it could not be read (None when all of it could).

    agentruns only stores what it validated, but a row edited by hand can hold JSON
    its models refuse. Such a row still reads, so that it can be listed, shown,
    cancelled and failed (a claim fails it with ``invalid_checkpoint``): a column
    that cannot be read reads as empty, the trigger as ``UNREADABLE_TRIGGER``, an
    error as an ``invalid_checkpoint`` one. A status agentruns does not know is not
    readable at all: that raises ``InvalidCheckpointError``."""
    try:
        status = RunStatus(row["status"])
    except ValueError:
        raise InvalidCheckpointError(
            f"run {row['id']} has a status agentruns does not know: {row['status']!r}"
        ) from None
    problems: list[str] = []
    trigger = _json(row, "trigger", TriggerEnvelope, problems, UNREADABLE_TRIGGER)
    claim = None
    if row["claim_owner"] is not None and row["claim_expires_at"] is not None:
        claim = Claim(owner=row["claim_owner"], expires_at=aware(row["claim_expires_at"]))
    run = Run(
        id=row["id"],
        agent=row["agent"],
        status=status,
        trigger=trigger or UNREADABLE_TRIGGER,
        idempotency_key=row["idempotency_key"],
        concurrency_key=row["concurrency_key"],
        thread=row["thread"],
        output=row["output"],
        error=_json(row, "error", RunError, problems, _UNREADABLE_ERROR),
        usage=Usage(
            input_tokens=row["input_tokens"],
            output_tokens=row["output_tokens"],
            cache_creation_input_tokens=row["cache_creation_input_tokens"],
            cache_read_input_tokens=row["cache_read_input_tokens"],
        ),
        steps_used=row["steps_used"],
        waiting=_json(row, "waiting", WaitPoint, problems),
        claim=claim,
        cancel_requested=row["cancel_requested"],
        budget=_json(row, "budget", Budget, problems),
        created_at=aware(row["created_at"]),
        updated_at=aware(row["updated_at"]),
        started_at=aware(row["started_at"]),
        finished_at=aware(row["finished_at"]),
    )
    if problems:
        return run, f"run {run.id}'s row: " + "; ".join(problems)
    return run, None


_LOGGED: set[str] = set()  # the damaged rows' problems logged so far


def run_from_row(row: RowMapping | dict[str, Any]) -> Run:
    """The run a row holds (a damaged row reads as ``read_run`` says, and is logged
    once per process: a watcher reads it again on every look)."""
    run, problem = read_run(row)
    if problem is not None and problem not in _LOGGED:
        if len(_LOGGED) < 1000:
            _LOGGED.add(problem)
        log.warning("cannot read all of %s", problem)
    return run


def run_updated(base: Run, row: dict[str, Any]) -> Run:
    """``base`` with the columns a write returned (no re-validation of the rest)."""
    # What a step's write leaves as it was (the claim, the status) is kept, not built
    # again: this runs after every write.
    claim, owner, expires_at = base.claim, row["claim_owner"], row["claim_expires_at"]
    if owner is None or expires_at is None:
        claim = None
    elif claim is None or claim.owner != owner or claim.expires_at != expires_at:
        claim = Claim(owner=owner, expires_at=aware(expires_at))
    status = base.status if base.status.value == row["status"] else RunStatus(row["status"])
    usage = base.usage
    if (row["input_tokens"], row["output_tokens"]) != (usage.input_tokens, usage.output_tokens):
        usage = Usage(
            input_tokens=row["input_tokens"],
            output_tokens=row["output_tokens"],
            cache_creation_input_tokens=row["cache_creation_input_tokens"],
            cache_read_input_tokens=row["cache_read_input_tokens"],
        )
    problems: list[str] = []  # only a damaged row's own columns can be: they read as empty
    return base.model_copy(
        update={
            "status": status,
            "output": row["output"],
            "error": _json(row, "error", RunError, problems, _UNREADABLE_ERROR),
            "usage": usage,
            "steps_used": row["steps_used"],
            "waiting": _json(row, "waiting", WaitPoint, problems),
            "claim": claim,
            "cancel_requested": row["cancel_requested"],
            "updated_at": aware(row["updated_at"]),
            "started_at": aware(row["started_at"]),
            "finished_at": aware(row["finished_at"]),
        }
    )


def new_steps(row: RowMapping | dict[str, Any], run_id: str, commit: Commit) -> list[Step]:
    first = row["step_count"] - len(commit.steps)
    return [
        Step(
            run_id=run_id,
            index=first + i,
            kind=s.kind,
            name=s.name,
            input=s.input,
            output=s.output,
            error=s.error,
            started_at=s.started_at,
            finished_at=s.finished_at,
        )
        for i, s in enumerate(commit.steps)
    ]


def step_from_row(run_id: str, row: RowMapping) -> Step:
    return Step(
        run_id=run_id,
        index=row["idx"],
        kind=row["kind"],
        name=row["name"],
        input=row["input"],
        output=row["output"],
        error=row["error"],
        started_at=aware(row["started_at"]),
        finished_at=aware(row["finished_at"]),
    )
