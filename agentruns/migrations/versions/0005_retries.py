"""The requests that retried a run are kept a week: a retry message delivered again
(its worker died before it acked, or it was retried through an outage after a first
try that went through) does not queue again a run that failed once more since.

And the schema's floor: the oldest revision whose releases work on the database
(``agentruns.migrations.FLOOR_TABLE``). This migration leaves 0004's working, so the
floor is 0004; releases from this one on read it, and keep working on a database a
later migration that leaves it so brought past what they know.

And each effect record's ``taken_over``: the attempt its last one took over, for an
attempt that says it failed (FatalToolError) to hand the intent back to, or not.

Tables of their own and a column the release before never reads, so its workers keep
working beside them.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "agentruns_retries",
        sa.Column("run_id", sa.String(64), primary_key=True),
        sa.Column("request_id", sa.String(200), primary_key=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_agentruns_retries_at", "agentruns_retries", ["at"])
    floor = op.create_table(
        "agentruns_schema_floor",
        sa.Column("revision", sa.String(32), primary_key=True),
    )
    op.bulk_insert(floor, [{"revision": "0004"}])
    op.add_column("agentruns_effects", sa.Column("taken_over", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("agentruns_effects", "taken_over")
    op.drop_table("agentruns_schema_floor")
    op.drop_table("agentruns_retries")
