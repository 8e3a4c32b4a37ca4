"""Opening a database: one SQLAlchemy engine per store, set up for how agentruns writes."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def make_engine(url: str, **kwargs: Any) -> Engine:
    """A SQLAlchemy engine with compact JSON and, for SQLite, safe concurrent writes."""
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    if url.startswith("sqlite"):
        engine = sa.create_engine(
            url,
            json_serializer=dumps,
            connect_args={"check_same_thread": False, "timeout": 30},
            **kwargs,
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
            # busy_timeout instead of failing with "database is locked".
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    # Connections are opened as needed and then kept, never opened for a burst and
    # closed after it ("overflow"): a new Postgres connection costs milliseconds of
    # CPU on both sides and starts with no prepared statements, and bursts are
    # what a worker's runs make when their model calls return together.
    kwargs.setdefault("pool_size", 30)
    kwargs.setdefault("max_overflow", 0)
    # No pre-ping round trip per checkout: a dead connection fails its write, which
    # aborts the execution (recover() finishes the run), and SQLAlchemy then
    # replaces the pool's connections.
    kwargs.setdefault("pool_recycle", 1800)
    return sa.create_engine(url, json_serializer=dumps, **kwargs)
