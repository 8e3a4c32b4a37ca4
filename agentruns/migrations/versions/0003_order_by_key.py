"""A concurrency key's runs (a thread's among them) wait in the order they were
stored (their key), not by the clocks of the processes that sent them: the index
that serves that order follows.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("agentruns_runs_key_created", table_name="agentruns_runs")
    op.create_index("agentruns_runs_key_order", "agentruns_runs", ["concurrency_key", "key"])


def downgrade() -> None:
    op.drop_index("agentruns_runs_key_order", table_name="agentruns_runs")
    op.create_index(
        "agentruns_runs_key_created", "agentruns_runs", ["concurrency_key", "created_at"]
    )
