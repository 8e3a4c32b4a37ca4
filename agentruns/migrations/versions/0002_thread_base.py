"""A thread's run reads the previous run's transcript through, instead of copying
it; a waiting run's token id gets a column of its own.

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
        batch.add_column(sa.Column("waiting_token", sa.String(64)))
    # Runs waiting now keep their token id.
    runs = sa.table(
        "agentruns_runs", sa.column("status"), sa.column("waiting", sa.JSON), sa.column("key")
    )
    conn = op.get_bind()
    for key, waiting in conn.execute(
        sa.select(runs.c.key, runs.c.waiting).where(runs.c.status == "waiting")
    ):
        if isinstance(waiting, dict) and isinstance(waiting.get("token_id"), str):
            conn.execute(
                sa.text("UPDATE agentruns_runs SET waiting_token = :t WHERE key = :k"),
                {"t": waiting["token_id"], "k": key},
            )


def downgrade() -> None:
    with op.batch_alter_table("agentruns_runs") as batch:
        batch.drop_column("waiting_token")
        batch.drop_column("base_count")
        batch.drop_column("base_key")
