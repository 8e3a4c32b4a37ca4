"""Opening a database: one SQLAlchemy engine per store, set up for how agentruns writes."""

from __future__ import annotations

import json
import os
import weakref
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg.pq import ConnStatus, ExecStatus, TransactionStatus
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import PoolProxiedConnection

from agentruns.errors import AgentrunsError, NotMigratedError

# One encoder for every write: json.dumps with options builds a new one per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


# An execution option: this connection only reads (SQLite then takes no write lock).
READ_ONLY = "agentruns_read_only"


def dumps(value: Any) -> str:
    """Compact JSON, with text as it is (no \\u escapes)."""
    return _ENCODER.encode(value)


def unsupported(url: str) -> str | None:
    """Why agentruns cannot use the database ``url`` names, or None: it takes Postgres
    through psycopg 3, or SQLite."""
    try:
        parsed = sa.make_url(url)
    except sa.exc.ArgumentError:
        return None  # SQLAlchemy's own message says what is wrong with it
    if parsed.drivername in (*_SQLITE, "postgresql", "postgresql+psycopg"):
        return None
    return (
        f"agentruns stores runs in Postgres (postgresql+psycopg://...) or SQLite"
        f" (sqlite:///...), not {parsed.drivername}://"
    )


def _check_supported(url: str) -> None:
    """Refuse an unsupported database or driver in one line, before SQLAlchemy looks
    for a driver module that is not there."""
    problem = unsupported(url)
    if problem is not None:
        raise AgentrunsError(f"{problem} (check AGENTRUNS_DATABASE_URL)")


# Every engine made here, so that a forked child lets go of its parent's connections.
_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


def _forget_parents_connections() -> None:
    """In a forked child: the pools' connections are the parent's sockets. The child
    opens its own; closing them (or writing on them) would break the parent's."""
    for engine in list(_ENGINES):
        engine.dispose(close=False)


os.register_at_fork(after_in_child=_forget_parents_connections)


# Query parameters of a URL that hold a credential (libpq's password and
# sslpassword; redis-py passes a password given there on).
_SECRET_PARAMETERS = ("password", "secret", "token")


# SQLite through the standard library's driver, the one agentruns speaks to it with.
_SQLITE = ("sqlite", "sqlite+pysqlite")


def is_sqlite_memory(url: str | sa.URL) -> bool:
    """Whether ``url`` is an in-memory SQLite database (one per connection, gone after)."""
    parsed = sa.make_url(url)
    path = parsed.database
    if parsed.drivername not in _SQLITE:
        return False
    return not path or path == ":memory:" or "mode=memory" in str(parsed)


def missing_sqlite_file(url: str | sa.URL) -> str | None:
    """The file a SQLite URL names, if it does not exist (opening it would create it,
    empty); None for any other URL."""
    parsed = sa.make_url(url)
    if parsed.drivername not in _SQLITE or is_sqlite_memory(parsed) or parsed.query.get("uri"):
        return None  # (a file: URI is SQLite's to read)
    path = parsed.database or ""
    return None if os.path.exists(path) else path


def shown_url(url: str | sa.URL) -> str:
    """A database or Redis URL as it may be shown: without the password of its user,
    nor any query parameter that holds one."""
    try:
        parsed = sa.make_url(url)
    except Exception:
        return str(url).split("@")[-1].split("?")[0]
    hidden = {
        key: "***" if any(word in key.lower() for word in _SECRET_PARAMETERS) else value
        for key, value in parsed.query.items()
    }
    return parsed.set(query=hidden).render_as_string(hide_password=True)


def make_engine(url: str, *, create: bool = False, **kwargs: Any) -> Engine:
    """A SQLAlchemy engine with compact JSON and, for SQLite, safe concurrent writes.
    Statements' parameters stay out of its errors: they hold triggers' payloads and
    transcripts, and errors reach logs, ``on_error`` and Celery's task events.

    A SQLite file that does not exist is created only if ``create`` (``migrate``):
    else opening it raises ``NotMigratedError``, and leaves no empty file behind (a
    typo's, which ``migrate`` would then take for the database meant)."""
    kwargs.setdefault("hide_parameters", True)
    engine = _make_engine(url, create, **kwargs)
    _ENGINES.add(engine)
    return engine


def _make_engine(url: str, create: bool, **kwargs: Any) -> Engine:
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    _check_supported(url)
    if url.startswith("sqlite"):
        return _sqlite_engine(url, create, **kwargs)
    return _postgres_engine(url, **kwargs)


def _sqlite_engine(url: str, create: bool, **kwargs: Any) -> Engine:
    engine = sa.create_engine(
        url,
        json_serializer=dumps,
        connect_args={"check_same_thread": False, "timeout": 30},
        **kwargs,
    )

    if not create:

        @sa.event.listens_for(engine, "do_connect")
        def _refuse_to_create(*_: Any) -> None:
            missing = missing_sqlite_file(url)
            if missing is not None:
                raise NotMigratedError(
                    f"the database {shown_url(url)} does not exist: run `agentruns migrate`"
                    " to create it (or check its URL)"
                )

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" below decide when a transaction starts.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # IMMEDIATE takes the write lock up front, so two writers queue on
        # busy_timeout instead of failing with "database is locked". A read
        # takes no lock: in WAL mode it reads its snapshot while a write goes on.
        read_only = conn.get_execution_options().get(READ_ONLY, False)
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine


def _postgres_engine(url: str, **kwargs: Any) -> Engine:
    # Connections are opened as needed and then kept, never opened for a burst and
    # closed after it ("overflow"): a new Postgres connection costs milliseconds of
    # CPU on both sides and starts with no prepared statements, and bursts are
    # what a worker's runs make when their model calls return together.
    if kwargs.get("poolclass") is None:
        kwargs["poolclass"] = _Pool
    if not issubclass(kwargs["poolclass"], sa.pool.QueuePool | sa.pool.NullPool):
        # One connection shared between threads (StaticPool), or one per thread
        # closed as others come (SingletonThreadPool): a worker's executions would
        # fail each other's statements.
        raise ValueError(
            f"agentruns' Postgres store takes a QueuePool or a NullPool, not"
            f" {kwargs['poolclass'].__name__}"
        )
    if issubclass(kwargs["poolclass"], sa.pool.QueuePool):  # a NullPool takes no sizes
        kwargs.setdefault("pool_size", 30)
        kwargs.setdefault("max_overflow", 0)
    # No pre-ping round trip per checkout, but a look at the socket (``closed``, on
    # checkout; the hot path's held connections, in held.py): a connection the
    # server ended while it sat idle (a restart, an idle timeout, a terminated
    # backend) is replaced before anything is sent on it. One that breaks while in
    # use fails its statement, which aborts the execution (recover() finishes the
    # run), and SQLAlchemy then replaces the pool's connections.
    kwargs.setdefault("pool_recycle", 1800)
    # A returned connection is rolled back only if it is inside a transaction (see
    # _rollback_if_in_transaction), instead of on every return.
    kwargs.setdefault("pool_reset_on_return", None)
    # A database that vanishes without closing the connection (its host dies, the
    # network partitions) must fail a statement in seconds, not in the kernel's
    # quarter of an hour: the execution then aborts and recover() finishes the run.
    # What the URL or the caller sets wins.
    given = sa.make_url(url).query
    connect_args = {k: v for k, v in _TCP.items() if k not in given}
    kwargs["connect_args"] = {**connect_args, **kwargs.get("connect_args", {})}
    engine = sa.create_engine(url, json_serializer=dumps, **kwargs)
    sa.event.listen(engine, "connect", _session_settings)
    sa.event.listen(engine, "reset", _rollback_if_in_transaction)
    sa.event.listen(engine, "checkout", _not_closed)
    return engine


class _Pool(sa.pool.QueuePool):
    """SQLAlchemy's pool, whose checkout replaces a connection the server ended at most
    twice and then raised ``InvalidRequestError`` ("This connection is closed"), an
    error no caller takes for an outage: an execution then failed its run (and a
    retry called an effect again whose result it held), where the server had only
    ended connections as they were opened (``pg_terminate_backend`` in a loop, a
    failover under way). This tries a few checkouts more, then says it as the
    disconnect it is (an outage: ``outages.py``)."""

    def connect(self) -> PoolProxiedConnection:
        checkouts = 0
        while True:
            try:
                return super().connect()
            except sa.exc.InvalidRequestError as exc:
                checkouts += 1
                if str(exc) != _ENDED_AT_CHECKOUT:
                    raise
                if checkouts == _CHECKOUTS:
                    raise sa.exc.DisconnectionError(
                        f"the server ended each connection {_CHECKOUTS * 2} checkouts"
                        " were given, as they were opened"
                    ) from exc


# SQLAlchemy's words when its checkout gave up (sqlalchemy/pool/base.py), and how many
# of its checkouts (of two connections each) one of this pool makes.
_ENDED_AT_CHECKOUT = "This connection is closed"
_CHECKOUTS = 4


def closed(driver: psycopg.Connection[Any]) -> bool:
    """Has the server ended this idle connection? It then said so (a FATAL message,
    then end of file) before anything was sent: a statement sent on it would fail,
    and a write that failed so could not be told from one that broke off halfway.
    No round trip: libpq reads what the socket holds without waiting, and (unlike
    a select()) without letting go of the GIL, which a worker's hundred threads
    would make it wait to take back."""
    pgconn = driver.pgconn
    if pgconn.status != ConnStatus.OK:
        return True
    if pgconn.transaction_status != TransactionStatus.IDLE:
        return False  # in a transaction: not an idle connection's to judge
    try:
        pgconn.consume_input()  # what came, if anything (end of file raises)
        pgconn.get_result()  # parsed: an error sent to an idle connection is a notice
    except psycopg.Error:
        return True
    return pgconn.status != ConnStatus.OK or driver in _ENDED


# The connections whose server said it ends them (FATAL, as a notice: they were idle).
_ENDED: weakref.WeakSet[psycopg.Connection[Any]] = weakref.WeakSet()


def _note_the_end(dbapi_conn: psycopg.Connection[Any]) -> None:
    connection = weakref.ref(dbapi_conn)

    def on_notice(diagnostic: psycopg.errors.Diagnostic) -> None:
        ended = connection()
        if ended is not None and diagnostic.severity_nonlocalized in ("FATAL", "PANIC"):
            _ENDED.add(ended)

    dbapi_conn.add_notice_handler(on_notice)


def _not_closed(dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
    # The pool replaces a connection this refuses, and checks out a new one.
    if closed(dbapi_conn):
        raise sa.exc.DisconnectionError("the server closed the connection while it was idle")


# libpq's connection options for that: a connect that hangs gives up after 10 s,
# a request the server does not acknowledge within 30 s fails, and an idle wait for
# a reply probes the server after 10 s, every 5 s, three times.
_TCP = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}


def _session_settings(dbapi_conn: Any, _record: Any) -> None:
    """Every Postgres connection of a store speaks UTF-8 and ISO dates in UTC, whatever
    its role, database or ``options`` default to: runs hold any text a model or a
    tool produces, the hot path sends its parameters as UTF-8, psycopg reads dates
    only in ``DateStyle`` ISO, and times read back in UTC print the same whatever
    the server's ``TimeZone``. Only what differs is set (usually nothing)."""
    _note_the_end(dbapi_conn)
    info = dbapi_conn.info
    wanted = []
    if info.encoding != "utf-8":
        wanted.append(b"client_encoding TO 'UTF8'")
    if not (info.parameter_status("DateStyle") or "ISO").startswith("ISO"):
        wanted.append(b"DateStyle TO 'ISO'")
    if info.parameter_status("TimeZone") not in ("UTC", "Etc/UTC", None):
        wanted.append(b"TimeZone TO 'UTC'")
    for setting in wanted:
        # Through libpq, so psycopg opens no transaction around it whatever its mode.
        result = dbapi_conn.pgconn.exec_(b"SET " + setting)
        if result.status != ExecStatus.COMMAND_OK:
            message = result.error_message.decode(errors="replace").strip()
            raise psycopg.OperationalError(f"cannot set {setting.decode()}: {message}")
    # A session cut off in the middle of a transaction (its client's network gone)
    # keeps the rows it wrote locked until the server notices, which its keepalives
    # take hours to: every other write to them waits. The server ends such a session
    # after a minute idle in its transaction, unless the role or database has a
    # limit of its own. (The store's transactions are milliseconds long.)
    result = dbapi_conn.pgconn.exec_(_IDLE_IN_TRANSACTION)
    if result.status != ExecStatus.TUPLES_OK:
        message = result.error_message.decode(errors="replace").strip()
        raise psycopg.OperationalError(f"cannot set idle_in_transaction_session_timeout: {message}")


_IDLE_IN_TRANSACTION = (
    b"SELECT set_config('idle_in_transaction_session_timeout', '60s', false)"
    b" WHERE current_setting('idle_in_transaction_session_timeout') = '0'"
)


def _rollback_if_in_transaction(dbapi_conn: Any, _record: Any, state: Any) -> None:
    """The pool's reset of a returned Postgres connection. The store's connections
    autocommit and the blocks that open a transaction end it, so a returned one is
    almost always idle. SQLAlchemy's own reset calls ``rollback()`` every time:
    nothing goes on the wire for an idle connection, but psycopg's machinery
    around it ran twice per model step. It is kept for the connections that need
    it, such as one leaked inside a transaction."""
    if state.terminate_only:
        return  # about to be closed anyway
    status = dbapi_conn.pgconn.transaction_status
    if status != TransactionStatus.IDLE and status != TransactionStatus.UNKNOWN:
        dbapi_conn.rollback()
