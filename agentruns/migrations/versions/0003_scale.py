"""What a large runs table needs: each concurrency key's line (its unfinished runs)
gets an index without its history; runs are listed newest first through indexes on
their creation time (the one on status alone gives way to one on status and
creation time).

Indexes only, so workers of the release before keep working beside it: their
statements, prepared on the table as it was, return the same columns. While an
index builds, writes to the runs table wait (reads do not), a few seconds per
million runs.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

LINE_WHERE = "status IN ('queued', 'running', 'interrupted') AND concurrency_key IS NOT NULL"


def upgrade() -> None:
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


def downgrade() -> None:
    op.create_index("agentruns_runs_status", "agentruns_runs", ["status"])
    for name in ("agent_created", "status_created", "created", "key_line"):
        op.drop_index(f"agentruns_runs_{name}", "agentruns_runs")
