"""Query fragments both databases' statements share: where a run stands in its
concurrency key's line, and how a run found by its id is matched, written so that
Postgres' prepared statements keep the plans they were made for."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from agentruns.errors import RunNotFoundError
from agentruns.runs import RunStatus
from agentruns.store import schema

R = schema.runs

# The status of a run found by its id: as an expression the status index cannot
# serve, so the id's unique index always finds the row. (psycopg prepares repeated
# statements; a generic plan could otherwise pick the status index and filter
# every run of that status.)
status_of_one = sa.func.coalesce(R.c.status, "")


def insert(table: sa.Table, dialect: str) -> Any:
    """``table``'s INSERT with ON CONFLICT, for the database ``dialect`` names."""
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        return pg_insert(table)
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    return sqlite_insert(table)


def literal(value: str) -> Any:
    """A value written into the statement, not sent as a parameter: the planner
    matches a query to a partial index's predicate only by values it sees, and a
    prepared statement's generic plan sees no parameter's."""
    return sa.bindparam(None, value, literal_execute=True)


def in_line(table: Any) -> Any:
    """The run holds a place in its concurrency key's line (the line's index predicate)."""
    return table.c.status.in_([literal(status) for status in schema.LINE])


def in_turn() -> Any:
    """The run is first in its concurrency key's line: no older run ahead of it, and
    none of its thread waiting on an approval (see claim.sql)."""
    older = R.alias("older")
    no_older = ~sa.exists(
        sa.select(older.c.id).where(
            older.c.concurrency_key == R.c.concurrency_key,
            in_line(older),
            # As a row comparison, the index bounds its scan by it (as an OR, it went
            # through the key's whole line, for each queued run a sweep looked at).
            sa.tuple_(older.c.created_at, older.c.id) < sa.tuple_(R.c.created_at, R.c.id),
        )
    )
    held = R.alias("held")
    not_held = ~sa.exists(
        sa.select(held.c.id).where(
            # By the thread's index, its unfinished runs (a waiting run has no finish);
            # not the status index nor the key's (hence the coalesces), which hold
            # every waiting run and the key's whole history.
            held.c.thread == R.c.thread,
            held.c.finished_at.is_(None),
            sa.func.coalesce(held.c.status, "") == literal(RunStatus.WAITING.value),
            sa.func.coalesce(held.c.concurrency_key, "") == R.c.concurrency_key,
            sa.tuple_(held.c.created_at, held.c.id) < sa.tuple_(R.c.created_at, R.c.id),
        )
    )
    # Only in a thread's own line (its key is the thread's, as dispatch makes it): a
    # key of the runs' own is a line others share, which one waiting run would hold.
    own_line = R.c.concurrency_key == literal(schema.THREAD_KEY) + R.c.thread
    return sa.or_(
        R.c.concurrency_key.is_(None),
        sa.and_(no_older, sa.or_(R.c.thread.is_(None), ~own_line, not_held)),
    )


def claimable(run_id: str) -> Any:
    """A query that finds the run if a claim of it would succeed now: queued, in
    turn, and no run of its key running (which the unique index would refuse)."""
    running = R.alias("running")
    key_free = ~sa.exists(
        sa.select(running.c.id).where(
            running.c.concurrency_key == R.c.concurrency_key,
            running.c.status == literal(RunStatus.RUNNING.value),
        )
    )
    return sa.select(R.c.id).where(
        R.c.id == run_id,
        R.c.status == RunStatus.QUEUED.value,
        in_turn(),
        sa.or_(R.c.concurrency_key.is_(None), key_free),
    )


def run_row(conn: Connection, run_id: str) -> RowMapping:
    """The run's row, read on ``conn``; ``RunNotFoundError`` if there is none."""
    row = conn.execute(sa.select(R).where(R.c.id == run_id)).mappings().first()
    if row is None:
        raise RunNotFoundError(run_id)
    return row
