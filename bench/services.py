"""A fresh Postgres database and Redis keys per benchmark, removed afterwards."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import redis

from agentruns.migrate import migrate

PG_ADMIN = os.environ.get("AGENTRUNS_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("AGENTRUNS_BENCH_REDIS", "redis://127.0.0.1:6379/0")


def _url(database: str) -> str:
    base, _, _ = PG_ADMIN.rpartition("/")
    return f"{base.replace('postgresql://', 'postgresql+psycopg://', 1)}/{database}"


def plain(url: str) -> str:
    """The libpq form of a SQLAlchemy URL, for psycopg."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


@contextmanager
def fresh_database() -> Iterator[str]:
    """A migrated database of its own (a SQLAlchemy URL), dropped at the end."""
    name = f"agentruns_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        url = _url(name)
        migrate(url)
        yield url
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def redis_prefix() -> Iterator[str]:
    """A key prefix of its own; its keys are deleted at the end."""
    prefix = f"agentruns-bench-{uuid.uuid4().hex[:10]}"
    try:
        yield prefix
    finally:
        delete_keys(f"{prefix}*")


def delete_keys(pattern: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(pattern))
        if keys:
            client.delete(*keys)
    finally:
        client.close()
