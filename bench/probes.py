"""What a figure's number is made of: commit latency here, round trips per step and
the time of the hot path's own statements."""

from __future__ import annotations

import collections
import os
import re
import time
from pathlib import Path
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


def round_trip_ms(url: str, n: int = 200) -> float:
    """Median time of a prepared ``SELECT 1``: the least any statement costs here."""
    with psycopg.connect(plain(url), autocommit=True) as conn:
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            conn.execute("SELECT 1", prepare=True)
            samples.append((time.perf_counter() - start) * 1000)
    return median(samples)


class Counter:
    """SQL statements (by their first words), transactions and Redis commands of one
    engine, and the wall time of each hot-path statement (by its prepared name)."""

    def __init__(self, engine: Engine, leases: RedisLeases) -> None:
        self.sql: collections.Counter[str] = collections.Counter()
        self.commits = 0
        self.redis: collections.Counter[str] = collections.Counter()
        self.hot_ms: collections.defaultdict[str, list[float]] = collections.defaultdict(list)
        store: Any = engine.store
        self._db: sa.Engine = store.engine
        sa.event.listen(self._db, "before_cursor_execute", self._statement)
        sa.event.listen(self._db, "commit", self._commit)
        # The Postgres hot path runs its statements on driver connections, past
        # SQLAlchemy's events: count them where they are sent.
        self._statements: Any = store.writes if hasattr(store.writes, "row") else None
        self._row = self._statements.row if self._statements is not None else None

        def row(statement: Any, *args: Any, **kwargs: Any) -> Any:
            self._statement(None, None, statement.text)
            start = time.perf_counter()
            try:
                return self._row(statement, *args, **kwargs)  # type: ignore[misc]
            finally:
                self.hot_ms[statement.name].append((time.perf_counter() - start) * 1000)

        if self._statements is not None:
            self._statements.row = row
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
        self.hot_ms.clear()
        self.commits = 0

    def remove(self) -> None:
        sa.event.remove(self._db, "before_cursor_execute", self._statement)
        sa.event.remove(self._db, "commit", self._commit)
        if self._statements is not None:
            self._statements.row = self._row
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
            # Each statement's round trip as this process waits for it: the server's
            # work, the WAL flush of a durable one, and the driver's share.
            "hot_statement_ms": {k: median(v) for k, v in sorted(self.hot_ms.items())},
        }


def cpu_by_command() -> dict[str, float]:
    """CPU seconds used so far by this machine's processes, summed by command name (Linux).

    A process that exits between two readings takes its share with it, so a
    difference of two readings is a lower bound for short-lived processes.
    """
    ticks = os.sysconf("SC_CLK_TCK")
    totals: collections.Counter[str] = collections.Counter()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            head, _, tail = (entry / "stat").read_text().rpartition(")")
        except OSError:
            continue
        fields = tail.split()
        totals[head.partition("(")[2]] += (int(fields[11]) + int(fields[12])) / ticks
    return dict(totals)


def machine_busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    ticks = os.sysconf("SC_CLK_TCK")
    return (sum(fields) - idle) / ticks, sum(fields) / ticks
