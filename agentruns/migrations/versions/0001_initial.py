"""Initial schema: runs, steps, messages, effects.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
RUN_KEY = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
RUNNING_WITH_KEY = "status = 'running' AND concurrency_key IS NOT NULL"


def upgrade() -> None:
    op.create_table(
        "agentruns_runs",
        sa.Column("key", RUN_KEY, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(64), nullable=False, unique=True),
        sa.Column("agent", sa.String(200), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("trigger", sa.JSON, nullable=False),
        sa.Column("idempotency_key", sa.String(500), unique=True),
        sa.Column("concurrency_key", sa.String(500)),
        sa.Column("thread", sa.String(500)),
        sa.Column("budget", sa.JSON),
        sa.Column("output", sa.Text),
        sa.Column("error", sa.JSON),
        sa.Column("input_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("output_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("cache_creation_input_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("cache_read_input_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("steps_used", sa.Integer, nullable=False, server_default="0"),
        sa.Column("step_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("message_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("epoch", sa.Integer, nullable=False, server_default="0"),
        sa.Column("waiting", sa.JSON),
        sa.Column("claim_owner", sa.String(200)),
        sa.Column("claim_expires_at", TS),
        sa.Column("cancel_requested", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("checkpoint_step", sa.Integer),
        sa.Column("checkpoint_messages", sa.Integer),
        sa.Column("checkpoint_reason", sa.String(64)),
        sa.Column("checkpoint_at", TS),
        sa.Column("state", sa.JSON),
        sa.Column("pending", sa.JSON),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("started_at", TS),
        sa.Column("finished_at", TS),
        postgresql_with={"fillfactor": 70},
    )
    op.create_index(
        "agentruns_runs_one_running_per_key",
        "agentruns_runs",
        ["concurrency_key"],
        unique=True,
        postgresql_where=sa.text(RUNNING_WITH_KEY),
        sqlite_where=sa.text(RUNNING_WITH_KEY),
    )
    op.create_index("agentruns_runs_status", "agentruns_runs", ["status"])
    op.create_index(
        "agentruns_runs_key_created", "agentruns_runs", ["concurrency_key", "created_at"]
    )
    op.create_index("agentruns_runs_thread", "agentruns_runs", ["thread", "finished_at"])
    op.create_table(
        "agentruns_steps",
        sa.Column("run_key", RUN_KEY, primary_key=True, autoincrement=False),
        sa.Column("idx", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("name", sa.String(200)),
        sa.Column("input", sa.JSON),
        sa.Column("output", sa.JSON),
        sa.Column("error", sa.JSON),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("finished_at", TS, nullable=False),
    )
    op.create_table(
        "agentruns_messages",
        sa.Column("run_key", RUN_KEY, primary_key=True, autoincrement=False),
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("body", sa.JSON, nullable=False),
    )
    op.create_table(
        "agentruns_effects",
        sa.Column("run_id", sa.String(64), primary_key=True),
        sa.Column("tool_call_id", sa.String(200), primary_key=True),
        sa.Column("tool_name", sa.String(200), nullable=False),
        sa.Column("idempotency_key", sa.String(300), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("result", sa.JSON),
        sa.Column("is_error", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("finished_at", TS),
    )


def downgrade() -> None:
    op.drop_table("agentruns_effects")
    op.drop_table("agentruns_messages")
    op.drop_table("agentruns_steps")
    op.drop_table("agentruns_runs")
