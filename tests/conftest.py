"""Fixtures: a fresh Postgres database per test session, a Redis prefix per test, engines.

Postgres and Redis are the real services on 127.0.0.1 (``make test`` starts them);
``AGENTRUNS_TEST_PG`` and ``AGENTRUNS_TEST_REDIS`` point elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
import pytest
import redis
import sqlalchemy as sa

from agentruns import Engine, LocalLeases, LocalScheduler, RedisLeases, SqlStore
from agentruns.migrate import migrate
from agentruns.store import schema
from bench.cluster import wait_for as poll

if TYPE_CHECKING:
    from tests.support.private_redis import PrivateRedis

PG_ADMIN = os.environ.get("AGENTRUNS_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("AGENTRUNS_TEST_REDIS", "redis://127.0.0.1:6379/0")


def _pg_url(database: str) -> str:
    base, _, _ = PG_ADMIN.rpartition("/")
    return f"{base.replace('postgresql://', 'postgresql+psycopg://', 1)}/{database}"


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A database of its own for this session, migrated, dropped at the end."""
    name = f"agentruns_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = _pg_url(name)
    migrate(url)
    yield url
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def empty_pg() -> Iterator[str]:
    """A database of its own for the test, never migrated, dropped at the end."""
    name = f"agentruns_empty_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield _pg_url(name)
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def drop_connections(url: str) -> None:
    """Every connection to ``url``'s database goes, as in a Postgres restart: ended,
    and gone by the time this returns (the server has closed their sockets)."""
    database = sa.make_url(url).database
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
            (database,),
        )
        deadline = time.monotonic() + 10
        while admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (database,)
        ).fetchone() != (0,):
            assert time.monotonic() < deadline, "the backends did not exit"
            time.sleep(0.01)


@contextlib.contextmanager
def database_away(url: str) -> Iterator[None]:
    """``url``'s database refuses connections and has none (a server that is down),
    until the block ends."""
    database = sa.make_url(url).database
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{database}" WITH ALLOW_CONNECTIONS false')
        try:
            drop_connections(url)
            yield
        finally:
            admin.execute(f'ALTER DATABASE "{database}" WITH ALLOW_CONNECTIONS true')


@pytest.fixture
def db_url(pg_url: str) -> str:
    """The session database, emptied before the test."""
    tables = ", ".join(t.name for t in schema.metadata.sorted_tables)
    with psycopg.connect(pg_url.replace("+psycopg", "", 1), autocommit=True) as conn:
        conn.execute(f"TRUNCATE {tables}")
    return pg_url


@pytest.fixture
def sqlite_url(tmp_path: Any) -> str:
    url = f"sqlite:///{tmp_path / 'agentruns.db'}"
    migrate(url)
    return url


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    prefix = f"agentruns-test-{uuid.uuid4().hex[:10]}"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


class Errors(list[Exception]):
    """What engines reported to ``on_error`` during a test."""

    def of(self, kind: type[Exception]) -> list[Exception]:
        return [e for e in self if isinstance(e, kind)]


@pytest.fixture
def errors() -> Errors:
    return Errors()


EngineFactory = Callable[..., Engine]


def _engines(url: str, errors: Errors, **defaults: Callable[[], Any]) -> Iterator[EngineFactory]:
    """Build engines on ``url``; each keyword not given is made by its default."""
    engines: list[Engine] = []

    def factory(agents: list[Any], **kwargs: Any) -> Engine:
        for name, make in defaults.items():
            if name not in kwargs:
                kwargs[name] = make()
        kwargs.setdefault("scheduler", LocalScheduler())
        kwargs.setdefault("secret", "test-secret")
        kwargs.setdefault("on_error", errors.append)
        engine = Engine(SqlStore(url), agents=agents, **kwargs)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.close()


@pytest.fixture
def make_engine(db_url: str, redis_prefix: str, errors: Errors) -> Iterator[EngineFactory]:
    """Engines on the real Postgres and Redis, closed at the end of the test."""
    yield from _engines(
        db_url,
        errors,
        leases=lambda: RedisLeases(REDIS_URL, prefix=redis_prefix),
        lease_ttl=lambda: 2.0,
    )


@pytest.fixture
def make_sqlite_engine(sqlite_url: str, errors: Errors) -> Iterator[EngineFactory]:
    """The embedded default: SQLite, in-process leases and scheduler."""
    yield from _engines(sqlite_url, errors, leases=LocalLeases)


def engines_on(request: pytest.FixtureRequest, store: str) -> EngineFactory:
    """``make_engine`` for ``store="postgres"``, ``make_sqlite_engine`` for "sqlite"."""
    name = "make_engine" if store == "postgres" else "make_sqlite_engine"
    factory: EngineFactory = request.getfixturevalue(name)
    return factory


@pytest.fixture(params=["postgres", "sqlite"])
def make_any_engine(request: pytest.FixtureRequest) -> EngineFactory:
    """The test runs twice: with engines on Postgres and Redis, then on SQLite."""
    return engines_on(request, request.param)


T = TypeVar("T")


def wait_for(check: Callable[[], T | None], what: str = "a condition", timeout: float = 20.0) -> T:
    """Poll ``check`` until it returns something truthy; that is the result.

    The benchmarks' poller, failing the test (not erroring it) on a timeout."""
    try:
        return poll(check, what, timeout)
    except TimeoutError as exc:
        raise AssertionError(str(exc)) from None


def trigger(payload: Any = None, **fields: Any) -> dict[str, Any]:
    """A manual trigger envelope as a dict."""
    return {"source": "manual", "trigger": "manual", "payload": payload, **fields}


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    """A ``redis-server`` of the test's own, which it may kill and start again."""
    from tests.support.private_redis import PrivateRedis

    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed; `make test` needs it")
    r = PrivateRedis()
    r.start()
    yield r
    r.kill()


def free_port() -> int:
    """A local TCP port nothing listens on (at the time of asking)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
