"""The Postgres hot path: the statements every run makes, each ONE autocommit statement.

Creating a run, claiming it and every guarded write are single statements
(``create.sql``, ``claim.sql``, ``commit.sql``) sent on the driver connection,
prepared, without SQLAlchemy's transaction and result layers: one round trip
each, no BEGIN or COMMIT of their own.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg.rows import dict_row, tuple_row

from agentruns.store.base import _UNSET, Commit, Guard, NewRun
from agentruns.store.connect import dumps

# What a write returns: every column a write can change, in this order.
WRITE_RETURNS = (
    "status",
    "output",
    "error",
    "input_tokens",
    "output_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "steps_used",
    "step_count",
    "message_count",
    "waiting",
    "claim_owner",
    "claim_expires_at",
    "cancel_requested",
    "updated_at",
    "started_at",
    "finished_at",
)


def _sql(name: str) -> str:
    """A statement file without its comments and indentation: the files explain, the
    server needs none of it, and psycopg caches the parsing of short statements
    only (up to 4 KiB): a longer one is parsed again on every execution."""
    text = (Path(__file__).parent / name).read_text()
    lines = (line.split("--", 1)[0].strip() for line in text.splitlines())
    statement = " ".join(line for line in lines if line)
    assert len(statement.encode()) <= 4096, f"{name} is too long to be cached by psycopg"
    return statement


_COMMIT = _sql("commit.sql")
COMMIT_SQL = _COMMIT.format(returns=", ".join(WRITE_RETURNS), lazy="")
COMMIT_LAZY_SQL = _COMMIT.format(returns=", ".join(WRITE_RETURNS), lazy=", lazy")
CLAIM_SQL = _sql("claim.sql")
CREATE_SQL = _sql("create.sql")


class Statements:
    """The ``Writes`` of a store, as single statements on its engine's pooled connections."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine

    def create(
        self, new: NewRun, now: datetime, claim: tuple[str, datetime] | None = None
    ) -> dict[str, Any] | None:
        """The new run's row (queued, or running under ``claim``: owner and expiry), or
        None if its idempotency key is taken."""
        params = new.columns(now, claim)
        params["trigger"] = dumps(params["trigger"])
        params["budget"] = dumps(params["budget"]) if params["budget"] is not None else None
        return self.row(CREATE_SQL, params)

    def claim(
        self, run_id: str, owner: str, expires_at: datetime, now: datetime
    ) -> dict[str, Any] | None:
        """The claimed run's row with its stored ``messages``; None if it cannot be claimed."""
        params = {"run_id": run_id, "owner": owner, "expires_at": expires_at, "now": now}
        try:
            return self.row(CLAIM_SQL, params)
        except sa.exc.IntegrityError:
            return None  # another run of the same concurrency key is running

    def commit(
        self, run_id: str, guard: Guard, commit: Commit, now: datetime
    ) -> dict[str, Any] | None:
        """Apply one guarded write; the changed columns (``WRITE_RETURNS``), or None on a miss."""
        sql = COMMIT_SQL if commit.durable else COMMIT_LAZY_SQL
        return self.row(sql, commit_params(run_id, guard, commit, now), WRITE_RETURNS)

    def row(
        self, sql: str, params: dict[str, Any], names: tuple[str, ...] | None = None
    ) -> dict[str, Any] | None:
        """One statement's first row: as ``names`` when given (skipping the column
        descriptions), else by the columns' own names. The store's connections
        autocommit, so the statement is its own transaction."""
        pooled = self.engine.raw_connection()
        try:
            cursor = _cursor(pooled)
            cursor.row_factory = tuple_row if names is not None else dict_row
            cursor.execute(sql, params, prepare=True)
            row = cursor.fetchone()
        except psycopg.IntegrityError as exc:
            raise sa.exc.IntegrityError(sql, params, exc) from exc
        except psycopg.OperationalError as exc:
            pooled.invalidate(exc)
            raise sa.exc.OperationalError(sql, params, exc) from exc
        finally:
            pooled.close()
        if row is None:
            return None
        if names is None:
            return dict(row)
        return dict(zip(names, row, strict=True))


def _cursor(pooled: Any) -> psycopg.Cursor[Any]:
    """The pooled connection's own cursor, made once per connection."""
    driver = pooled.driver_connection
    cursor: psycopg.Cursor[Any] | None = pooled.info.get(_CURSOR)
    if cursor is None or cursor.closed or cursor.connection is not driver:
        if not driver.autocommit:
            raise RuntimeError("the store's Postgres connections must autocommit")
        cursor = driver.cursor()
        pooled.info[_CURSOR] = cursor
    return cursor


_CURSOR = "agentruns.cursor"


def commit_params(run_id: str, guard: Guard, commit: Commit, now: datetime) -> dict[str, Any]:
    usage = commit.usage
    final = commit.status is not None and commit.status.is_final
    return {
        "now": now,
        "run_id": run_id,
        "guard_status": guard.status.value,
        "guard_epoch": guard.epoch,
        "guard_token": guard.token_id,
        "n_steps": len(commit.steps),
        "n_messages": len(commit.messages),
        "model_calls": commit.model_calls,
        "input_tokens": usage.input_tokens if usage else 0,
        "output_tokens": usage.output_tokens if usage else 0,
        "cache_creation": usage.cache_creation_input_tokens if usage else 0,
        "cache_read": usage.cache_read_input_tokens if usage else 0,
        "checkpoint": commit.checkpoint is not None,
        "checkpoint_step": commit.checkpoint[0] if commit.checkpoint else None,
        "checkpoint_reason": commit.checkpoint[1] if commit.checkpoint else None,
        "set_state": commit.state is not None,
        "state": dumps(commit.state) if commit.state is not None else None,
        "set_pending": commit.pending is not _UNSET,
        "pending": dumps(commit.pending) if commit.pending not in (_UNSET, None) else None,
        "status": commit.status.value if commit.status is not None else None,
        "final": final,
        "output": commit.output,
        "set_error": commit.error is not None,
        "error": dumps(commit.error.model_dump(mode="json")) if commit.error else None,
        "set_waiting": commit.waiting is not _UNSET,
        "waiting": (
            dumps(commit.waiting.model_dump(mode="json"))
            if commit.waiting not in (_UNSET, None)
            else None
        ),
        "release": commit.release_claim,
        "steps": dumps(
            [
                {
                    "kind": s.kind,
                    "name": s.name,
                    "input": s.input,
                    "output": s.output,
                    "error": s.error,
                    "started_at": s.started_at.isoformat(),
                    "finished_at": s.finished_at.isoformat(),
                }
                for s in commit.steps
            ]
        ),
        "messages": dumps(commit.messages),
    }
