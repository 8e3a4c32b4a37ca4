"""Rows to run types: how a stored run, step or write result reads back as pydantic models."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy.engine import RowMapping

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


def aware(value: datetime | None) -> datetime | None:
    # SQLite hands back naive datetimes; everything we store is UTC.
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


def run_from_row(row: RowMapping | dict[str, Any]) -> Run:
    claim = None
    if row["claim_owner"] is not None and row["claim_expires_at"] is not None:
        claim = Claim(owner=row["claim_owner"], expires_at=aware(row["claim_expires_at"]))
    return Run(
        id=row["id"],
        agent=row["agent"],
        status=RunStatus(row["status"]),
        trigger=TriggerEnvelope.model_validate(row["trigger"]),
        idempotency_key=row["idempotency_key"],
        concurrency_key=row["concurrency_key"],
        thread=row["thread"],
        output=row["output"],
        error=RunError.model_validate(row["error"]) if row["error"] else None,
        usage=Usage(
            input_tokens=row["input_tokens"],
            output_tokens=row["output_tokens"],
            cache_creation_input_tokens=row["cache_creation_input_tokens"],
            cache_read_input_tokens=row["cache_read_input_tokens"],
        ),
        steps_used=row["steps_used"],
        waiting=WaitPoint.model_validate(row["waiting"]) if row["waiting"] else None,
        claim=claim,
        cancel_requested=row["cancel_requested"],
        budget=Budget.model_validate(row["budget"]) if row["budget"] else None,
        created_at=aware(row["created_at"]),
        updated_at=aware(row["updated_at"]),
        started_at=aware(row["started_at"]),
        finished_at=aware(row["finished_at"]),
    )


def run_updated(base: Run, row: dict[str, Any]) -> Run:
    """``base`` with the columns a write returned (no re-validation of the rest)."""
    claim = None
    if row["claim_owner"] is not None and row["claim_expires_at"] is not None:
        claim = Claim(owner=row["claim_owner"], expires_at=aware(row["claim_expires_at"]))
    usage = base.usage
    if (row["input_tokens"], row["output_tokens"]) != (usage.input_tokens, usage.output_tokens):
        usage = Usage(
            input_tokens=row["input_tokens"],
            output_tokens=row["output_tokens"],
            cache_creation_input_tokens=row["cache_creation_input_tokens"],
            cache_read_input_tokens=row["cache_read_input_tokens"],
        )
    waiting = row["waiting"]
    return base.model_copy(
        update={
            "status": RunStatus(row["status"]),
            "output": row["output"],
            "error": RunError.model_validate(row["error"]) if row["error"] else None,
            "usage": usage,
            "steps_used": row["steps_used"],
            "waiting": WaitPoint.model_validate(waiting) if waiting else None,
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
