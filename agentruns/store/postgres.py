"""The Postgres hot path: the statements every run makes, each ONE autocommit statement.

Creating a run, claiming it and every guarded write are single statements
(``create.sql``, ``claim.sql``, ``commit.sql``), prepared once per connection
and then executed through libpq (psycopg's ``pq`` layer) with text parameters:
one round trip each, no BEGIN or COMMIT of their own, and none of the cursor,
query-conversion and transaction layers above it. A step's writes are most of an
execution's CPU: this is where it pays to be lean.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import psycopg
import sqlalchemy as sa
from psycopg import pq
from psycopg.adapt import Transformer

from agentruns.store import schema
from agentruns.store.base import _UNSET, Commit, Guard, NewRun
from agentruns.store.connect import dumps
from agentruns.store.held import Held

# What a write returns: every column a write can change, in this order.
WRITE_RETURNS = (
    "status",
    "output",
    "error",
    "input_tokens",
    "output_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "steps_used",
    "step_count",
    "message_count",
    "waiting",
    "claim_owner",
    "claim_expires_at",
    "cancel_requested",
    "updated_at",
    "started_at",
    "finished_at",
)


def _sql(name: str) -> str:
    """A statement file without its comments and indentation: the files explain, the
    server needs none of it."""
    text = (Path(__file__).parent / name).read_text()
    lines = (line.split("--", 1)[0].strip() for line in text.splitlines())
    return " ".join(line for line in lines if line)


class Prepared:
    """One statement as the server prepares it: the text with positional parameters
    (``$1`` for the first name in ``%(name)s`` form), the names in that order, and
    the names of the result's columns (named in the statement: never ``*``, which a
    later release's migration adding a column would change under it)."""

    def __init__(self, name: str, sql: str, returns: tuple[str, ...]) -> None:
        order: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match.group(1) not in order:
                order.append(match.group(1))
            return f"${order.index(match.group(1)) + 1}"

        self.name = name
        self.text = re.sub(r"%\((\w+)\)s", number, sql)
        self.params = tuple(order)
        self.columns = returns
        # Named by its text too: a session that already holds a statement of this
        # name (see _prepare) holds this very text, whichever release prepared it.
        digest = hashlib.blake2b(self.text.encode(), digest_size=4).hexdigest()
        self.wire_name = f"{name}_{digest}".encode()
        self.wire_text = self.text.encode()

    def values(self, params: dict[str, Any]) -> Sequence[bytes]:
        # None is SQL NULL to libpq (the pq layer's own stubs type it only for sends).
        # Two writes a step of some thirty parameters each: by the value's exact type
        # first (the commonest), about a third less time than ``_text``'s checks.
        by_type = _TEXT_BY_TYPE
        return cast(
            "list[bytes]",
            [
                by_type.get(type(value), _text)(value)
                for value in map(params.__getitem__, self.params)
            ],
        )


_COMMIT = _sql("commit.sql")


def _commit(name: str, appends: str, lazy: bool) -> Prepared:
    sql = _COMMIT.format(
        returns=", ".join(WRITE_RETURNS), appends=_sql(appends), lazy=", lazy" if lazy else ""
    )
    return Prepared(name, sql, WRITE_RETURNS)


# A write is one of four statements: any appends or exactly one step and one
# message (most writes, and a cheaper statement for Postgres), durable or not.
COMMIT = _commit("agentruns_commit", "append_many.sql", lazy=False)
COMMIT_LAZY = _commit("agentruns_commit_lazy", "append_many.sql", lazy=True)
COMMIT_ONE = _commit("agentruns_commit_one", "append_one.sql", lazy=False)
COMMIT_ONE_LAZY = _commit("agentruns_commit_one_lazy", "append_one.sql", lazy=True)
_RUN_COLUMNS = tuple(column.name for column in schema.runs.columns)
CLAIM = Prepared(
    "agentruns_claim",
    _sql("claim.sql").format(
        run_columns=", ".join(f"run.{name}" for name in _RUN_COLUMNS),
        thread_key=schema.THREAD_KEY,
    ),
    (*_RUN_COLUMNS, "messages"),
)
CREATE = Prepared(
    "agentruns_create", _sql("create.sql").format(columns=", ".join(_RUN_COLUMNS)), _RUN_COLUMNS
)


class Statements:
    """The ``Writes`` of a store, as single statements on its engine's pooled connections."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.held = Held(engine, _Session.of)

    def release(self) -> None:
        """Give the connections held between writes back to the pool, for good."""
        self.held.close()

    def create(
        self, new: NewRun, now: datetime, claim: tuple[str, datetime] | None = None
    ) -> dict[str, Any] | None:
        """The new run's row (queued, or running under ``claim``: owner and expiry), or
        None if its idempotency key is taken."""
        params = new.columns(now, claim)
        params["trigger"] = dumps(params["trigger"])
        params["budget"] = dumps(params["budget"]) if params["budget"] is not None else None
        # Sent again if the connection was gone: a first try that did commit makes
        # the second find the idempotency key taken, which is what it would have said,
        # or, for a run without one, its own id. Either way the caller then reads the
        # run, and takes a claimed one with this claim's owner and expiry for its own.
        try:
            return self._once_more_if_gone(CREATE, params)
        except sa.exc.IntegrityError:
            return None  # only its id can be taken: by a first try that did commit

    def claim(
        self, run_id: str, owner: str, expires_at: datetime, now: datetime
    ) -> dict[str, Any] | None:
        """The claimed run's row with its stored ``messages``; None if it cannot be claimed."""
        params = {"run_id": run_id, "owner": owner, "expires_at": expires_at, "now": now}
        try:
            # Sent again if the connection was gone: a first try that did commit
            # makes the second find the run claimed with this owner and expiry, which
            # claim.sql takes for this claim's own.
            return self._once_more_if_gone(CLAIM, params)
        except sa.exc.IntegrityError:
            return None  # another run of the same concurrency key is running

    def _once_more_if_gone(
        self, statement: Prepared, params: dict[str, Any]
    ) -> dict[str, Any] | None:
        """``row``, tried again on a new connection if its connection was gone: after
        Postgres restarted, or dropped it while it sat in the pool, the first
        statement to use it failed (the run waited for recover(), a dispatch
        failed). Only for statements whose second try can do no harm."""
        try:
            return self.row(statement, params)
        except sa.exc.OperationalError as exc:
            if not exc.connection_invalidated:
                raise
            return self.row(statement, params)

    def commit(
        self, run_id: str, guard: Guard, commit: Commit, now: datetime
    ) -> dict[str, Any] | None:
        """Apply one guarded write; the changed columns (``WRITE_RETURNS``), or None on a miss."""
        params = commit_params(run_id, guard, commit, now)
        if _one_step_one_message(commit):
            statement = COMMIT_ONE if commit.durable else COMMIT_ONE_LAZY
        else:
            statement = COMMIT if commit.durable else COMMIT_LAZY
        return self.row(statement, params)

    def row(self, statement: Prepared, params: dict[str, Any]) -> dict[str, Any] | None:
        """The statement's first row by column name, or None. The connection is idle
        (the store's connections autocommit), so the statement is its own transaction."""
        pooled, session, since = self.held.take()
        reusable = False
        try:
            row = session.row(statement, params)
            reusable = True
            return row
        except psycopg.IntegrityError as exc:
            reusable = True  # the statement failed, the connection did not
            raise sa.exc.IntegrityError(statement.text, params, exc, hide_parameters=True) from exc
        except psycopg.OperationalError as exc:
            gone = session.driver.pgconn.status == pq.ConnStatus.BAD
            if gone:
                # The connection is gone, and what broke it (a restart, a failover) may
                # have broken every other: they reconnect on their next checkout, as
                # SQLAlchemy's own execution does on a disconnect.
                self.engine.pool._invalidate(pooled, exc)
            else:
                pooled.invalidate(exc)
            self.held.drop()  # what broke this one may have broken them too
            raise sa.exc.OperationalError(
                statement.text, params, exc, hide_parameters=True, connection_invalidated=gone
            ) from exc
        finally:
            self.held.give(pooled, session, since, reusable)


class _Session:
    """What one pooled connection keeps for the hot path: the statements prepared on
    it, and a loader that turns result values into Python ones as psycopg would."""

    def __init__(self, driver: psycopg.Connection[Any]) -> None:
        # Parameters are sent as UTF-8: the store's connections all speak it (connect.py).
        self.driver = driver
        self.prepared: set[str] = set()
        self.loader = Transformer(driver)

    @classmethod
    def of(cls, pooled: Any) -> _Session:
        driver = pooled.driver_connection
        session: _Session | None = pooled.info.get(_SESSION)
        if session is None or session.driver is not driver:
            session = pooled.info[_SESSION] = cls(driver)
        return session

    def row(self, statement: Prepared, params: dict[str, Any]) -> dict[str, Any] | None:
        pgconn = self.driver.pgconn
        if pgconn.transaction_status != pq.TransactionStatus.IDLE:
            # Inside a transaction, this write would not be its own.
            raise RuntimeError("a hot-path statement needs an idle autocommit connection")
        values = statement.values(params)
        size = sum(map(len, filter(None, values)))  # None is NULL
        if size > MOST_BYTES:
            # The server would drop the connection ("invalid message length"): taken
            # for an outage, the run would be retried, and refused again, forever.
            raise ValueError(
                f"a write of {size / 1e6:,.0f} MB is more than Postgres takes in one"
                f" statement ({MOST_BYTES / 1e6:,.0f} MB)"
            )
        if statement.name not in self.prepared:
            self._prepare(statement)
        result = pgconn.exec_prepared(statement.wire_name, values)
        if result.status != pq.ExecStatus.TUPLES_OK and _sqlstate(result) == _NO_SUCH_STATEMENT:
            # Dropped under us (a proxy's DISCARD ALL; psycopg's own DEALLOCATE ALL when
            # a transaction of its auto-prepared queries rolls back): prepare it again.
            # Only this one: those prepared since are still there, and each that was
            # dropped too says so when next used.
            self.prepared.discard(statement.name)
            self._prepare(statement)
            result = pgconn.exec_prepared(statement.wire_name, values)
        self._check(result, pq.ExecStatus.TUPLES_OK)
        if result.ntuples == 0:
            return None
        self.loader.set_pgresult(result)
        row = self.loader.load_row(0, tuple)
        return dict(zip(statement.columns, row, strict=True))

    def _prepare(self, statement: Prepared) -> None:
        result = self.driver.pgconn.prepare(statement.wire_name, statement.wire_text)
        if _sqlstate(result) != _ALREADY_PREPARED:  # the same text: its name says so
            self._check(result, pq.ExecStatus.COMMAND_OK)
        self.prepared.add(statement.name)

    def _check(self, result: pq.abc.PGresult, expected: pq.ExecStatus) -> None:
        if result.status == expected:
            return
        message = result.error_message.decode(errors="replace").strip()
        if self.driver.pgconn.status != pq.ConnStatus.OK:
            raise psycopg.OperationalError(message or "the connection is broken")
        sqlstate = _sqlstate(result)
        error = psycopg.errors.lookup(sqlstate) if sqlstate else psycopg.DatabaseError
        raise error(message)


def _sqlstate(result: pq.abc.PGresult) -> str | None:
    code = result.error_field(pq.DiagnosticField.SQLSTATE)
    return code.decode() if code else None


def _text(value: Any) -> bytes | None:
    """A parameter in Postgres' text format (the server infers its type)."""
    if value is None:
        return None
    if value is True:
        return b"t"
    if value is False:
        return b"f"
    if isinstance(value, str):
        return _str_text(value)
    if isinstance(value, datetime):
        return value.isoformat().encode()
    if isinstance(value, int | float):
        return str(value).encode()
    raise TypeError(f"no text form for a parameter of type {type(value).__name__}")


def _str_text(value: str) -> bytes:
    if "\x00" in value:  # libpq would cut the text there
        raise ValueError(f"Postgres text cannot hold a NUL character: {value[:80]!r}")
    return value.encode()


def _null(_: None) -> None:
    return None


# ``_text`` of the commonest exact types, without its chain of isinstance checks.
_TEXT_BY_TYPE: dict[type, Callable[[Any], bytes | None]] = {
    str: _str_text,
    type(None): _null,
    bool: lambda value: b"t" if value else b"f",
    int: lambda value: str(value).encode(),
    datetime: lambda value: value.isoformat().encode(),
}


# What one statement's parameters may add up to: Postgres takes a message of at
# most 1 GiB, the statement's name and framing included.
MOST_BYTES = 2**30 - 2**20

_SESSION = "agentruns.session"
_NO_SUCH_STATEMENT = "26000"
_ALREADY_PREPARED = "42P05"


def commit_params(run_id: str, guard: Guard, commit: Commit, now: datetime) -> dict[str, Any]:
    """The parameters of a guarded write (commit.sql with append_many.sql, or with
    append_one.sql for one step and one message): the run's columns, then its rows."""
    params = _run_params(run_id, guard, commit, now)
    params.update(_rows_params(commit))
    return params


def _run_params(run_id: str, guard: Guard, commit: Commit, now: datetime) -> dict[str, Any]:
    usage = commit.usage
    final = commit.status is not None and commit.status.is_final
    params = {
        "now": now,
        "run_id": run_id,
        "guard_status": guard.status.value,
        "guard_epoch": guard.epoch,
        "guard_token": guard.token_id,
        "n_steps": len(commit.steps),
        "n_messages": len(commit.messages),
        "model_calls": commit.model_calls,
        "input_tokens": usage.input_tokens if usage else 0,
        "output_tokens": usage.output_tokens if usage else 0,
        "cache_creation": usage.cache_creation_input_tokens if usage else 0,
        "cache_read": usage.cache_read_input_tokens if usage else 0,
        "checkpoint": commit.checkpoint is not None,
        "checkpoint_step": commit.checkpoint[0] if commit.checkpoint else None,
        "checkpoint_reason": commit.checkpoint[1] if commit.checkpoint else None,
        "set_state": commit.state is not None,
        "state": dumps(commit.state) if commit.state is not None else None,
        "set_pending": commit.pending is not _UNSET,
        "pending": dumps(commit.pending) if commit.pending not in (_UNSET, None) else None,
        "status": commit.status.value if commit.status is not None else None,
        "final": final,
        "output": commit.output,
        "set_error": commit.error is not None,
        "error": dumps(commit.error.model_dump(mode="json")) if commit.error else None,
        "set_waiting": commit.waiting is not _UNSET,
        "waiting_token": (
            commit.waiting.token_id if commit.waiting not in (_UNSET, None) else None
        ),
        "waiting": (
            dumps(commit.waiting.model_dump(mode="json"))
            if commit.waiting not in (_UNSET, None)
            else None
        ),
        "release": commit.release_claim,
    }
    return params


def _rows_params(commit: Commit) -> dict[str, Any]:
    steps, messages = commit.steps, commit.messages
    if _one_step_one_message(commit):  # COMMIT_ONE's parameters
        step = steps[0]
        return {
            "step_kind": step.kind,
            "step_name": step.name,
            "step_input": dumps(step.input) if step.input is not None else None,
            "step_output": dumps(step.output) if step.output is not None else None,
            "step_error": dumps(step.error) if step.error is not None else None,
            "step_started_at": step.started_at,
            "step_finished_at": step.finished_at,
            "message": dumps(messages[0]),
        }
    return {
        "step_kinds": dumps([s.kind for s in steps]),
        "step_names": dumps([s.name for s in steps]),
        "step_inputs": dumps([s.input for s in steps]),
        "step_outputs": dumps([s.output for s in steps]),
        "step_errors": dumps([s.error for s in steps]),
        "step_started_at": dumps([s.started_at.isoformat() for s in steps]),
        "step_finished_at": dumps([s.finished_at.isoformat() for s in steps]),
        "messages": dumps(messages),
    }


def _one_step_one_message(commit: Commit) -> bool:
    return len(commit.steps) == 1 and len(commit.messages) == 1
