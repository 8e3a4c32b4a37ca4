"""What a large runs table needs: a waiting run's expiry and notification time get
columns of their own, which ``tick`` reads instead of the whole wait point; each
concurrency key's line (its unfinished runs) gets an index without its history;
runs are listed newest first through indexes on their creation time (the one on
status alone gives way to one on status and creation time).

Until it commits, the runs table is locked (by adding its columns): reads and
writes of it wait, for a few seconds per million runs.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
# Waiting runs whose wait points are read at a time (each holds a tool's input).
_BATCH = 200
LINE_WHERE = "status IN ('queued', 'running', 'interrupted') AND concurrency_key IS NOT NULL"


def upgrade() -> None:
    with op.batch_alter_table("agentruns_runs") as batch:
        batch.add_column(sa.Column("waiting_expires_at", TS))
        batch.add_column(sa.Column("waiting_notified_at", TS))
    _copy_waiting_times()
    # agentruns_runs_key_created stays while a release before 0003 may run: its
    # claims find the runs ahead of them through it.
    op.create_index(
        "agentruns_runs_key_line",
        "agentruns_runs",
        ["concurrency_key", "created_at", "id"],
        postgresql_where=sa.text(LINE_WHERE),
        sqlite_where=sa.text(LINE_WHERE),
    )
    op.create_index("agentruns_runs_created", "agentruns_runs", ["created_at"])
    op.create_index("agentruns_runs_status_created", "agentruns_runs", ["status", "created_at"])
    op.create_index("agentruns_runs_agent_created", "agentruns_runs", ["agent", "created_at"])
    op.drop_index("agentruns_runs_status", "agentruns_runs")


def _copy_waiting_times() -> None:
    """Runs waiting now get their wait point's times. Read in Python, as 0002 read the
    token id: Postgres refuses to take a field out of JSON holding a \\u0000 anywhere.
    A wait point that holds no readable expiry keeps none: ``tick`` reads such a run
    in full, as it read every waiting run before."""
    runs = sa.table(
        "agentruns_runs",
        sa.column("key"),
        sa.column("status"),
        sa.column("waiting", sa.JSON),
        sa.column("waiting_expires_at", TS),
        sa.column("waiting_notified_at", TS),
    )
    conn = op.get_bind()
    keys = [
        key
        for (key,) in conn.execute(
            sa.select(runs.c.key).where(runs.c.status == "waiting").order_by(runs.c.key)
        )
    ]
    for start in range(0, len(keys), _BATCH):
        batch = keys[start : start + _BATCH]
        for key, waiting in conn.execute(
            sa.select(runs.c.key, runs.c.waiting).where(runs.c.key.in_(batch))
        ):
            if not isinstance(waiting, dict):
                continue
            expires_at = _time(waiting.get("expires_at"))
            if expires_at is None:
                continue
            conn.execute(
                runs.update()
                .where(runs.c.key == key)
                .values(
                    waiting_expires_at=expires_at,
                    waiting_notified_at=_time(waiting.get("notified_at")),
                )
            )


def _time(value: Any) -> datetime | None:
    """A time as a wait point stores it (ISO 8601), or None if it is not one."""
    if not isinstance(value, str):
        return None
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        return None
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def downgrade() -> None:
    op.create_index("agentruns_runs_status", "agentruns_runs", ["status"])
    for name in ("agent_created", "status_created", "created", "key_line"):
        op.drop_index(f"agentruns_runs_{name}", "agentruns_runs")
    with op.batch_alter_table("agentruns_runs") as batch:
        batch.drop_column("waiting_notified_at")
        batch.drop_column("waiting_expires_at")
