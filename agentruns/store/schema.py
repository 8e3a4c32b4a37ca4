"""The whole database contract: every table agentruns stores, in one place.

Messages are append-only, one row per message; a run's checkpoint is a
pointer on its row (step index, message count, finish reason), so the bytes
written per step do not grow with the transcript.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

# A step's name: its tool's, or the model's (what a model asks for is cut to this).
STEP_NAME_LENGTH = 200

metadata = sa.MetaData()

TS = sa.DateTime(timezone=True)

# Steps and messages point at their run by this 8-byte key, not by the 36-character
# id: they are the rows written on every step, and so is their primary key index.
RunKey = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


class JSON(sa.TypeDecorator[Any]):
    """JSON, read back as its text where that text is not JSON at all. SQLite keeps
    JSON as text, which a hand edit can leave as anything; decoding it failed a whole
    read (every list of runs), where a value of the wrong shape reads as unreadable,
    that column alone (``rows.read_run``). Postgres refuses such text, and decodes
    its own JSON (then there is nothing to decode here)."""

    impl = sa.JSON
    cache_ok = True

    def result_processor(self, dialect: Any, coltype: Any) -> Callable[[Any], Any] | None:
        decode = self.impl_instance.result_processor(dialect, coltype)
        if decode is None:
            return None

        def tolerant(value: Any) -> Any:
            try:
                return decode(value)
            except ValueError:  # json's JSONDecodeError is one
                return value

        return tolerant


# The longest idempotency key, concurrency key or thread name, in characters.
KEY_LENGTH = 500
# An engine's owner name, in a claim (Engine refuses a longer one).
OWNER_LENGTH = 200

# The most tokens of a kind a run's counter holds (a bigint, on SQLite too).
MOST_TOKENS = 2**63 - 1

# The longest request id a retry is known by (a Celery task id; longer are hashed).
REQUEST_ID_LENGTH = 200
# How long a retry's request is remembered, in days.
RETRY_REQUEST_DAYS = 7

# The longest agent name, in characters.
AGENT_NAME_LENGTH = 200

# The longest tool call id (a model's; the Messages API's are about 30 characters).
TOOL_CALL_ID_LENGTH = 200
# The longest stop_reason a checkpoint keeps (the API's are a few words).
STOP_REASON_LENGTH = 64

# The statuses of the runs that hold a place in their concurrency key's line: an
# older run queued, running, or interrupted (by a drain, until recover() requeues
# it) holds back a newer queued one (see claim.sql). In a thread's own line, an
# older run of it waiting on an approval does too (by the thread's index).
LINE = ("queued", "running", "interrupted")
# A thread's own concurrency key (its runs' unless they have one of their own) is
# this and its name: its line is the thread's, which a waiting run also holds.
THREAD_KEY = "thread:"
LINE_WHERE = f"status IN ({', '.join(map(repr, LINE))}) AND concurrency_key IS NOT NULL"

runs = sa.Table(
    "agentruns_runs",
    metadata,
    sa.Column("key", RunKey, primary_key=True, autoincrement=True),
    sa.Column("id", sa.String(64), nullable=False, unique=True),
    sa.Column("agent", sa.String(AGENT_NAME_LENGTH), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("trigger", JSON, nullable=False),
    sa.Column("idempotency_key", sa.String(KEY_LENGTH), unique=True),
    sa.Column("concurrency_key", sa.String(KEY_LENGTH)),
    sa.Column("thread", sa.String(KEY_LENGTH)),
    sa.Column("budget", JSON),
    sa.Column("output", sa.Text),
    sa.Column("error", JSON),
    sa.Column("input_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("output_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("cache_creation_input_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("cache_read_input_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("steps_used", sa.Integer, nullable=False, server_default="0"),
    # Next step index and number of stored messages: appends never read the history.
    sa.Column("step_count", sa.Integer, nullable=False, server_default="0"),
    sa.Column("message_count", sa.Integer, nullable=False, server_default="0"),
    # A run in a thread continues the transcript of the thread's previous completed
    # run: that run's key and how many messages it holds, read through, not copied.
    # The run's own messages are numbered on from there.
    sa.Column("base_key", RunKey),
    sa.Column("base_count", sa.Integer),
    # Fencing epoch: bumped by every claim; every write of a running run names it.
    sa.Column("epoch", sa.Integer, nullable=False, server_default="0"),
    sa.Column("waiting", JSON),
    # The waiting wait point's token id, which a resume's guard compares: read out
    # of the JSON, a \u0000 anywhere in the tool's input made Postgres refuse it.
    sa.Column("waiting_token", sa.String(64)),
    sa.Column("claim_owner", sa.String(OWNER_LENGTH)),
    sa.Column("claim_expires_at", TS),
    sa.Column("cancel_requested", sa.Boolean, nullable=False, server_default=sa.false()),
    # The checkpoint pointer (SPEC §5) and the agent state stored with it.
    sa.Column("checkpoint_step", sa.Integer),
    sa.Column("checkpoint_messages", sa.Integer),
    sa.Column("checkpoint_reason", sa.String(STOP_REASON_LENGTH)),
    sa.Column("checkpoint_at", TS),
    sa.Column("state", JSON),
    # Results and approval answers of the step in progress (see execution.py).
    sa.Column("pending", JSON),
    sa.Column("created_at", TS, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
    sa.Column("started_at", TS),
    sa.Column("finished_at", TS),
    # At most one running run per concurrency key, enforced by the database.
    sa.Index(
        "agentruns_runs_one_running_per_key",
        "concurrency_key",
        unique=True,
        postgresql_where=sa.text("status = 'running' AND concurrency_key IS NOT NULL"),
        sqlite_where=sa.text("status = 'running' AND concurrency_key IS NOT NULL"),
    ),
    # No index names a column that every step writes (updated_at, the counters):
    # per-step updates of the run row stay HOT, adding no index entries.
    # Listing runs newest first, all of them, of a status or of an agent, reads the
    # newest entries of one of these three; each status's runs are also its sweeps'.
    sa.Index("agentruns_runs_created", "created_at"),
    sa.Index("agentruns_runs_status_created", "status", "created_at"),
    sa.Index("agentruns_runs_agent_created", "agent", "created_at"),
    sa.Index("agentruns_runs_key_created", "concurrency_key", "created_at"),
    # The line of each concurrency key: its unfinished runs, oldest first. Claims and
    # sweeps look for an older run ahead of one, and ``next_queued`` for the first:
    # through the index above, they walked every run the key ever finished (a chat
    # thread's whole history). A query names the statuses as here, in literals (see
    # transactions.py's ``literal``).
    sa.Index(
        "agentruns_runs_key_line",
        "concurrency_key",
        "created_at",
        "id",
        postgresql_where=sa.text(LINE_WHERE),
        sqlite_where=sa.text(LINE_WHERE),
    ),
    sa.Index("agentruns_runs_thread", "thread", "finished_at"),
    # Room in each page for the row's next versions, so HOT updates stay in place.
    postgresql_with={"fillfactor": 70},
)

steps = sa.Table(
    "agentruns_steps",
    metadata,
    sa.Column("run_key", RunKey, primary_key=True, autoincrement=False),
    sa.Column("idx", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("kind", sa.String(8), nullable=False),
    sa.Column("name", sa.String(STEP_NAME_LENGTH)),
    sa.Column("input", JSON),
    sa.Column("output", JSON),
    sa.Column("error", JSON),
    sa.Column("started_at", TS, nullable=False),
    sa.Column("finished_at", TS, nullable=False),
)

messages = sa.Table(
    "agentruns_messages",
    metadata,
    sa.Column("run_key", RunKey, primary_key=True, autoincrement=False),
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("body", JSON, nullable=False),
)

# Executions that ended unsettled (their worker died, or gave the run up in an
# outage) and were recovered, in a row at one step: recover() holds back a run lost
# again and again at its step (a step that ends the process that runs it, such as
# a crash or an out-of-memory kill, would take down a worker on every recovery, and
# every run that worker held with it). A table of its own, not columns of the runs:
# a release before it still running beside it (a rolling deploy) reads runs rows
# of the shape it knows.
crashes = sa.Table(
    "agentruns_crashes",
    metadata,
    sa.Column("run_id", sa.String(64), primary_key=True),
    # The run's step count when its execution was lost; a loss at another step
    # (the run got on meanwhile) starts the count again.
    sa.Column("at_step", sa.Integer, nullable=False),
    sa.Column("times", sa.Integer, nullable=False),
)

# The oldest revision whose releases work on the database, one row (see
# agentruns.migrations.FLOOR_TABLE).
schema_floor = sa.Table(
    "agentruns_schema_floor",
    metadata,
    sa.Column("revision", sa.String(32), primary_key=True),
)

# The requests that retried a run (a retry task's message id): a message delivered
# again (its worker died before it acked, or it was retried through an outage after
# a first try that went through) does not queue again a run that failed once more
# since. Rows are written only by retries, and kept a week (RETRY_REQUEST_DAYS).
# A table of its own, as the crashes' is.
retries = sa.Table(
    "agentruns_retries",
    metadata,
    sa.Column("run_id", sa.String(64), primary_key=True),
    sa.Column("request_id", sa.String(REQUEST_ID_LENGTH), primary_key=True),
    sa.Column("at", TS, nullable=False, index=True),
)

effects = sa.Table(
    "agentruns_effects",
    metadata,
    sa.Column("run_id", sa.String(64), primary_key=True),
    sa.Column("tool_call_id", sa.String(TOOL_CALL_ID_LENGTH), primary_key=True),
    sa.Column("tool_name", sa.String(200), nullable=False),
    sa.Column("idempotency_key", sa.String(300), nullable=False),
    # "started" once the intent is recorded, "done" once the result is.
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("result", JSON),
    sa.Column("is_error", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("started_at", TS, nullable=False),
    sa.Column("finished_at", TS),
    # The started_at of the attempt the last one took over, while its outcome is
    # unknown: an attempt that says it failed (FatalToolError) hands the intent back
    # to it; none (a first attempt, or one that said it failed too), it is deleted.
    sa.Column("taken_over", TS),
)
