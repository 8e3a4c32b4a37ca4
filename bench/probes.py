"""What a figure's number is made of: commit latency here and round trips per step."""

from __future__ import annotations

import collections
import re
import time
from typing import Any

import psycopg
import sqlalchemy as sa

from agentruns import Engine, RedisLeases
from bench.report import median
from bench.services import plain

_WRITE = re.compile(r"\b(INSERT|UPDATE|DELETE)\b", re.IGNORECASE)


def commit_latency_ms(url: str, n: int = 100) -> float:
    """Median time of one autocommitted single-row insert: mostly the WAL flush of a commit."""
    with psycopg.connect(plain(url), autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_probe (x int)")
        samples = []
        for i in range(n):
            start = time.perf_counter()
            conn.execute("INSERT INTO bench_probe VALUES (%s)", (i,))
            samples.append((time.perf_counter() - start) * 1000)
        conn.execute("DROP TABLE bench_probe")
    return median(samples)


class Counter:
    """SQL statements (by their first words), transactions and Redis commands of one engine."""

    def __init__(self, engine: Engine, leases: RedisLeases) -> None:
        self.sql: collections.Counter[str] = collections.Counter()
        self.commits = 0
        self.redis: collections.Counter[str] = collections.Counter()
        self._db: sa.Engine = engine.store.engine  # type: ignore[attr-defined]
        sa.event.listen(self._db, "before_cursor_execute", self._statement)
        sa.event.listen(self._db, "commit", self._commit)
        self._client: Any = leases._client
        self._original = self._client.execute_command

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.redis[str(args[0])] += 1
            return self._original(*args, **kwargs)

        self._client.execute_command = counted

    def _statement(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        # Named by its first words, after any leading comment lines.
        body = re.sub(r"^(\s*--[^\n]*\n)+", "", statement)
        self.sql[re.sub(r"\s+", " ", body).strip()[:80]] += 1

    def _commit(self, conn: Any) -> None:
        self.commits += 1

    def reset(self) -> None:
        self.sql.clear()
        self.redis.clear()
        self.commits = 0

    def remove(self) -> None:
        sa.event.remove(self._db, "before_cursor_execute", self._statement)
        sa.event.remove(self._db, "commit", self._commit)
        self._client.execute_command = self._original

    def per_step(self, steps: int) -> dict[str, Any]:
        writes = sum(n for k, n in self.sql.items() if _WRITE.search(k))
        return {
            "sql_statements": sum(self.sql.values()) / steps,
            "sql_writes": writes / steps,
            "explicit_commits": self.commits / steps,
            "redis_commands": sum(self.redis.values()) / steps,
            "sql_by_statement": {k: round(n / steps, 3) for k, n in self.sql.most_common()},
            "redis_by_command": {k: round(n / steps, 3) for k, n in self.redis.most_common()},
        }
