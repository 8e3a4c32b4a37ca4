"""The writes every run makes, as SQLAlchemy transactions: the SQLite side of the hot path.

The same three operations as ``store/postgres.py``'s ``Statements`` (create a run,
claim it, apply a guarded write) and the same results, in portable SQL: a
transaction of a few statements each, with ``BEGIN IMMEDIATE`` taking SQLite's
write lock up front (see ``connect.py``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError

from agentruns.runs import RunStatus, utcnow
from agentruns.store import history, schema
from agentruns.store.base import _UNSET, Commit, Guard, NewRun
from agentruns.store.queries import in_turn

R = schema.runs
S = schema.steps
M = schema.messages


class Transactions:
    """The ``Writes`` of a store, as transactions on a SQLAlchemy engine."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine

    def create(
        self, new: NewRun, now: datetime, claim: tuple[str, datetime] | None = None
    ) -> dict[str, Any] | None:
        """The new run's row (queued, or running under ``claim``: owner and expiry), or
        None if its idempotency key is taken."""
        with self.engine.begin() as conn:
            # The time once the write lock is held: a thread's runs go in the order
            # of their creation times, which must be the order they were stored in.
            insert = sqlite_insert(R).values(**new.columns(_locked(now), claim))
            if new.idempotency_key is not None:
                insert = insert.on_conflict_do_nothing(index_elements=["idempotency_key"])
            row = conn.execute(insert.returning(*R.c)).mappings().first()
        return dict(row) if row is not None else None

    def claim(
        self, run_id: str, owner: str, expires_at: datetime, now: datetime
    ) -> dict[str, Any] | None:
        """The claimed run's row with its stored ``messages``; None if it cannot be claimed."""
        try:
            with self.engine.begin() as conn:
                row = (
                    conn.execute(_claim(run_id, owner, expires_at, _locked(now))).mappings().first()
                )
                if row is None:
                    return None
                try:
                    messages = history.messages(conn, row["key"], row["message_count"])
                except ValueError as exc:  # a stored message that is not JSON
                    # The claim stands: the execution fails the run invalid_checkpoint,
                    # instead of every recovery claiming it and failing again.
                    return {**row, "messages": [], "damaged": f"a stored message: {exc}"}
        except IntegrityError:
            return None  # another run of the same concurrency key is running
        return {**row, "messages": list(messages)}

    def commit(
        self, run_id: str, guard: Guard, commit: Commit, now: datetime
    ) -> dict[str, Any] | None:
        """Apply one guarded write; the run's row after it, or None on a miss."""
        stmt = R.update().where(R.c.id == run_id, R.c.status == guard.status.value)
        if guard.epoch is not None:
            stmt = stmt.where(R.c.epoch == guard.epoch)
        if guard.token_id is not None:
            stmt = stmt.where(R.c.waiting_token == guard.token_id)
        stmt = stmt.values(**_changes(commit, now)).returning(*R.c)
        with self.engine.begin() as conn:
            row = conn.execute(stmt).mappings().first()
            if row is None:
                return None
            key = row["key"]
            if commit.steps:
                first_step = row["step_count"] - len(commit.steps)
                conn.execute(
                    S.insert(),
                    [
                        {
                            "run_key": key,
                            "idx": first_step + i,
                            "kind": s.kind,
                            "name": s.name,
                            "input": s.input,
                            "output": s.output,
                            "error": s.error,
                            "started_at": s.started_at,
                            "finished_at": s.finished_at,
                        }
                        for i, s in enumerate(commit.steps)
                    ],
                )
            if commit.messages:
                first_message = row["message_count"] - len(commit.messages)
                conn.execute(
                    M.insert(),
                    [
                        {"run_key": key, "seq": first_message + i, "body": m}
                        for i, m in enumerate(commit.messages)
                    ],
                )
        return dict(row)

    def release(self) -> None:
        """Nothing to give back: each write checks its connection out and in again."""


def _claim(run_id: str, owner: str, expires_at: datetime, now: datetime) -> Any:
    """queued -> running with a new epoch, oldest first per concurrency key."""
    return (
        R.update()
        .where(R.c.id == run_id, R.c.status == RunStatus.QUEUED.value)
        .where(in_turn())
        .values(
            status=RunStatus.RUNNING.value,
            epoch=R.c.epoch + 1,
            claim_owner=owner,
            claim_expires_at=expires_at,
            started_at=sa.func.coalesce(R.c.started_at, now),
            updated_at=now,
        )
        .returning(*R.c)
    )


def _changes(commit: Commit, now: datetime) -> dict[str, Any]:
    """The run row's new values for one write (what commit.sql computes on Postgres)."""
    n_msgs = len(commit.messages)
    values: dict[str, Any] = {"updated_at": now}
    if commit.steps:
        values["step_count"] = R.c.step_count + len(commit.steps)
    if n_msgs:
        values["message_count"] = R.c.message_count + n_msgs
    if commit.model_calls:
        values["steps_used"] = R.c.steps_used + commit.model_calls
    if commit.usage is not None:
        u = commit.usage
        values["input_tokens"] = R.c.input_tokens + u.input_tokens
        values["output_tokens"] = R.c.output_tokens + u.output_tokens
        values["cache_creation_input_tokens"] = (
            R.c.cache_creation_input_tokens + u.cache_creation_input_tokens
        )
        values["cache_read_input_tokens"] = R.c.cache_read_input_tokens + u.cache_read_input_tokens
    if commit.checkpoint is not None:
        values["checkpoint_step"] = commit.checkpoint[0]
        values["checkpoint_reason"] = commit.checkpoint[1]
        values["checkpoint_messages"] = R.c.message_count + n_msgs
        values["checkpoint_at"] = now
    if commit.state is not None:
        values["state"] = commit.state
    if commit.pending is not _UNSET:
        values["pending"] = commit.pending
    if commit.status is not None:
        values["status"] = commit.status.value
        if commit.status.is_final:
            values["finished_at"] = now
    if commit.output is not None:
        values["output"] = commit.output
    if commit.status is RunStatus.COMPLETED:
        # A cancel asked for while the run ran wins over its final answer (commit.sql).
        cancelled = R.c.cancel_requested.is_(True)
        values["status"] = sa.case((cancelled, RunStatus.CANCELLED.value), else_=values["status"])
        values["output"] = sa.case((cancelled, R.c.output), else_=values.get("output"))
    if commit.error is not None:
        values["error"] = commit.error.model_dump(mode="json")
    if commit.waiting is not _UNSET:
        values["waiting_token"] = commit.waiting.token_id if commit.waiting is not None else None
        values["waiting"] = (
            commit.waiting.model_dump(mode="json") if commit.waiting is not None else None
        )
    if commit.release_claim:
        values["claim_owner"] = None
        values["claim_expires_at"] = None
    return values


def _locked(asked: datetime) -> datetime:
    """The time of a write whose transaction holds SQLite's write lock (BEGIN
    IMMEDIATE): taken before, it was as early as the wait for the lock was long, and
    a run stored after another could read as created before it."""
    return max(asked, utcnow())
