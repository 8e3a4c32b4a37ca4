"""Executions that ended unsettled are counted, per run and step: recover() holds a
run lost again and again at its step back longer each time, instead of handing a
step that kills its worker to another worker on every sweep.

A table of its own, so workers of the release before keep working beside it (their
statements read the runs table as it was).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "agentruns_crashes",
        sa.Column("run_id", sa.String(64), primary_key=True),
        sa.Column("at_step", sa.Integer, nullable=False),
        sa.Column("times", sa.Integer, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("agentruns_crashes")
