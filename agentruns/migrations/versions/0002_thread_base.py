"""A thread's run reads the previous run's transcript through, instead of copying it.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

RUN_KEY = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    # Runs stored before this keep their copied history: no base, as they were.
    with op.batch_alter_table("agentruns_runs") as batch:
        batch.add_column(sa.Column("base_key", RUN_KEY))
        batch.add_column(sa.Column("base_count", sa.Integer))


def downgrade() -> None:
    with op.batch_alter_table("agentruns_runs") as batch:
        batch.drop_column("base_count")
        batch.drop_column("base_key")
