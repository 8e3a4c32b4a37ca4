"""Figure 5: from ``kill -9`` of the worker executing a run to the run running elsewhere.

Two workers and beat run with a short lease (``AGENTRUNS_LEASE_TTL``) and
recover interval (``AGENTRUNS_RECOVER_INTERVAL``). A long run (model latency)
starts; the worker named in its claim (``host:pid:random``) is killed; the
store is polled until the run is ``running`` under another owner. Each repeat
kills one worker and starts a replacement, so two workers always compete.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psycopg

from agentruns import CeleryScheduler, Engine, RedisLeases, SqlStore
from bench import agents, workload
from bench.cluster import SECRET, celery_queue, cluster, forget_leases, producer_app, wait_for
from bench.report import Figure, median, spread
from bench.services import REDIS_URL, fresh_database, plain

LEASE_TTL_S = 3.0
RECOVER_INTERVAL_S = 2.0
TARGET_S = LEASE_TTL_S + RECOVER_INTERVAL_S + 1.0


def _state(conn: psycopg.Connection[Any], run_id: str) -> tuple[str, str | None, int]:
    row = conn.execute(
        "SELECT status, claim_owner, steps_used FROM agentruns_runs WHERE id = %s", (run_id,)
    ).fetchone()
    assert row is not None
    return row[0], row[1], row[2]


def one_kill(
    conn: psycopg.Connection[Any], engine: Engine, group: Any, n: int
) -> dict[str, float | str]:
    run = engine.dispatch("bench_long", workload.trigger(n))

    def in_flight() -> str | None:
        status, owner, steps = _state(conn, run.id)
        # A couple of steps saved: the worker is mid-run, inside a model call.
        return owner if status == "running" and owner and steps >= 2 else None

    owner = wait_for(in_flight, "the long run to be executing", 60)
    victim = group.by_pid(int(owner.split(":")[-2]))
    killed = time.perf_counter()
    os.kill(victim.pid, signal.SIGKILL)

    requeued_at: float | None = None

    def elsewhere() -> bool:
        nonlocal requeued_at
        status, now_owner, _ = _state(conn, run.id)
        if status == "queued" and requeued_at is None:
            requeued_at = time.perf_counter()
        if status not in ("running", "queued"):
            raise RuntimeError(f"the run became {status}")
        return status == "running" and now_owner is not None and now_owner != owner

    wait_for(elsewhere, "the run to run again on another worker", TARGET_S * 4, every=0.01)
    back = time.perf_counter()
    victim.popen.wait(timeout=5)
    engine.cancel(run.id)  # the survivor lets it go; the next repeat starts a fresh run
    return {
        "seconds": back - killed,
        "requeued_after_s": (requeued_at - killed) if requeued_at else float("nan"),
        "victim": victim.name,
    }


def measure(repeat: int, quick: bool) -> list[Figure]:
    kills: list[dict[str, Any]] = []
    with fresh_database() as url, celery_queue() as queue:
        engine: Engine | None = None
        try:
            with cluster(
                url,
                queue,
                lease_ttl=str(LEASE_TTL_S),
                recover_interval=str(RECOVER_INTERVAL_S),
                slots="8",
            ) as group:
                group.workers("w1", "w2", concurrency=8)
                group.beat()
                app = producer_app(queue)
                engine = Engine(
                    SqlStore(url),
                    leases=RedisLeases(REDIS_URL),
                    scheduler=CeleryScheduler(app),
                    agents=[agents.long_run],
                    secret=SECRET,
                    lease_ttl=LEASE_TTL_S,
                )
                with psycopg.connect(plain(url), autocommit=True) as conn:
                    try:
                        for n in range(repeat):
                            kills.append(one_kill(conn, engine, group, n))
                            if n + 1 < repeat:
                                group.workers(f"w{n + 3}", concurrency=8)
                    except Exception as exc:
                        raise RuntimeError(f"{exc}\n{group.tail()}") from exc
        finally:
            if engine is not None:
                engine.close()
            with psycopg.connect(plain(url), autocommit=True) as conn:
                forget_leases([r[0] for r in conn.execute("SELECT id FROM agentruns_runs")])
    seconds = [k["seconds"] for k in kills]
    return [
        Figure(
            id="5",
            name=f"recovery after kill -9 (lease {LEASE_TTL_S:g} s, recover every"
            f" {RECOVER_INTERVAL_S:g} s)",
            unit="s",
            value=median(seconds),
            target=TARGET_S,
            detail={"seconds": spread(seconds), "kills": kills},
        )
    ]
