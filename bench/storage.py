"""Figure 3: bytes stored per model step at S = 300.

``pg_total_relation_size`` (heap, indexes, TOAST) of every ``agentruns_*``
table after N runs, minus the same for the freshly migrated, empty tables,
divided by the model steps taken; once as written, once after a plain
``VACUUM`` (which frees dead row versions for reuse but rarely shrinks files).
"""

from __future__ import annotations

from typing import Any

import psycopg

from agentruns import Engine, RedisLeases, SqlStore
from agentruns.schedulers import ManualScheduler
from bench import workload
from bench.report import Figure
from bench.services import REDIS_URL, fresh_database, plain, redis_prefix

STEPS = 300
RUNS, QUICK_RUNS = 20, 3
TARGET_BYTES = 1.5 * 1024


def table_sizes(url: str) -> dict[str, int]:
    with psycopg.connect(plain(url), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE c.relkind = 'r' AND n.nspname = 'public' AND c.relname LIKE 'agentruns\\_%'"
        ).fetchall()
    return dict(rows)


def _breakdown(url: str) -> dict[str, dict[str, Any]]:
    """Per table: heap, index and TOAST bytes, live and dead rows, mean stored row size."""
    out: dict[str, dict[str, Any]] = {}
    with psycopg.connect(plain(url), autocommit=True) as conn:
        for name in table_sizes(url):
            heap, indexes, toast = conn.execute(
                "SELECT pg_relation_size(c.oid), pg_indexes_size(c.oid),"
                " coalesce(pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0)"
                " FROM pg_class c WHERE c.relname = %s",
                (name,),
            ).fetchone()
            rows, row_bytes = conn.execute(
                f"SELECT count(*), coalesce(avg(pg_column_size(t.*)), 0) FROM {name} t"
            ).fetchone()
            dead = conn.execute(
                "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = %s", (name,)
            ).fetchone()
            out[name] = {
                "heap": heap,
                "indexes": indexes,
                "toast": toast,
                "rows": rows,
                "mean_row_bytes": round(float(row_bytes)),
                "dead_rows": dead[0] if dead else None,
            }
    return out


def measure(repeat: int, quick: bool) -> list[Figure]:
    runs = QUICK_RUNS if quick else RUNS
    agent = workload.agent("bench_storage", STEPS)
    errors: list[Exception] = []
    with fresh_database() as url, redis_prefix() as prefix:
        empty = table_sizes(url)
        engine = Engine(
            SqlStore(url),
            leases=RedisLeases(REDIS_URL, prefix=prefix),
            scheduler=ManualScheduler(),
            agents=[agent],
            secret="bench",
            on_error=errors.append,
        )
        try:
            for i in range(runs):
                run_id = engine.dispatch(agent.name, workload.trigger(i)).id
                engine.execute(run_id)
                workload.check_completed(engine, run_id, STEPS)
        finally:
            engine.close()
        if errors:
            raise RuntimeError(f"the engine reported errors: {errors[:3]}")
        raw = table_sizes(url)
        raw_breakdown = _breakdown(url)
        with psycopg.connect(plain(url), autocommit=True) as conn:
            for name in raw:
                conn.execute(f"VACUUM {name}")
        vacuumed = table_sizes(url)
        vacuumed_breakdown = _breakdown(url)

    steps = runs * STEPS

    def per_step(sizes: dict[str, int]) -> float:
        return (sum(sizes.values()) - sum(empty.values())) / steps

    def per_table(sizes: dict[str, int]) -> dict[str, float]:
        return {name: round((sizes[name] - empty.get(name, 0)) / steps, 1) for name in sizes}

    common = {"runs": runs, "steps_per_run": STEPS, "empty_bytes": sum(empty.values())}
    return [
        Figure(
            id="3",
            name=f"bytes stored per step, S = {STEPS}, as written",
            unit="B",
            value=per_step(raw),
            target=TARGET_BYTES,
            detail={**common, "per_table": per_table(raw), "tables": raw_breakdown},
        ),
        Figure(
            id="3b",
            name=f"bytes stored per step, S = {STEPS}, after VACUUM",
            unit="B",
            value=per_step(vacuumed),
            target=TARGET_BYTES,
            detail={**common, "per_table": per_table(vacuumed), "tables": vacuumed_breakdown},
        ),
    ]
