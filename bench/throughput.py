"""Figure 4: runs per second through real Celery workers (threads pool).

500 runs of S = 5 steps with a 200 ms model latency go to two workers
``-P threads -c 100``, dispatched with ``agentruns.tasks.dispatch`` (the
producer's call; the worker that stores a run executes it). The clock runs
from the first dispatch to the last run's ``finished_at``, after one
unmeasured batch of 200 runs that opens every thread's connections. With 200
runs in flight and about 1 s of model time per run, the ideal is 200 runs/s;
efficiency is the achieved rate over that. (500 runs on 200 slots take three
rounds of runs, the last one half full: even with no overhead at all, the rate
cannot pass 500 / 3 s, an efficiency of 0.83.)

Figure 4b is a control, measured on the same workers right after each batch:
the same second of model time per run in one step (one model call of 1 s, no
tool), where the engine does the least a run can (store it claimed, one
write). What 4b misses of 0.83 is Celery's and this machine's; what figure 4
misses of 4b is the engine's work for the four more steps."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg

from bench import agents, workload
from bench.cluster import Proc, celery_queue, cluster, forget_leases, producer_app, wait_for
from bench.probes import cpu_by_command, machine_busy_seconds
from bench.report import Figure, median, spread
from bench.services import fresh_database, plain


@dataclass
class Sizes:
    runs: int = 500
    workers: int = 2
    concurrency: int = 100


QUICK = Sizes(runs=100)


def ideal_rate(sizes: Sizes) -> float:
    return sizes.workers * sizes.concurrency / agents.THROUGHPUT_SECONDS_PER_RUN


def ceiling(sizes: Sizes) -> float:
    """The efficiency of no overhead at all: runs go in whole rounds of the slots."""
    rounds = math.ceil(sizes.runs / (sizes.workers * sizes.concurrency))
    return sizes.runs / (rounds * agents.THROUGHPUT_SECONDS_PER_RUN) / ideal_rate(sizes)


def _counts(conn: psycopg.Connection[Any], batch: str) -> dict[str, int]:
    rows = conn.execute(
        "SELECT status, count(*) FROM agentruns_runs WHERE idempotency_key LIKE %s GROUP BY 1",
        (f"{batch}-%",),
    ).fetchall()
    return {status: n for status, n in rows}


def one_batch(
    conn: psycopg.Connection[Any],
    queue: str,
    batch: str,
    sizes: Sizes,
    workers: list[Proc],
    agent: str = agents.throughput.name,
) -> dict[str, Any]:
    from agentruns.tasks import dispatch

    cpu_before = [w.cpu_seconds() or 0.0 for w in workers]
    services_before = cpu_by_command()
    busy_before = machine_busy_seconds()
    producer_cpu = time.process_time()
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    # One producer (connection and channel) for the whole batch, as a producer
    # sending many tasks in a loop would hold it.
    with dispatch.app.producer_or_acquire() as producer:
        for i in range(sizes.runs):
            dispatch.apply_async(
                (agent, workload.trigger(i)),
                {"idempotency_key": f"{batch}-{i}"},
                queue=queue,
                producer=producer,
            )
    sent_s = time.perf_counter() - t0
    producer_cpu = time.process_time() - producer_cpu

    def finished() -> dict[str, int] | None:
        counts = _counts(conn, batch)
        bad = {s: n for s, n in counts.items() if s not in ("queued", "running", "completed")}
        if bad:
            raise RuntimeError(f"runs ended badly: {counts}")
        return counts if counts.get("completed", 0) == sizes.runs else None

    try:
        wait_for(finished, f"{sizes.runs} runs to complete", timeout=60 + sizes.runs / 5, every=0.1)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}: {_counts(conn, batch)}") from None
    last_finished, latency, wait, busy = conn.execute(
        "SELECT max(finished_at),"
        " percentile_cont(ARRAY[0.5, 0.95]) WITHIN GROUP"
        " (ORDER BY extract(epoch FROM finished_at - created_at)),"
        " percentile_cont(ARRAY[0.5, 0.95]) WITHIN GROUP"
        " (ORDER BY extract(epoch FROM started_at - created_at)),"
        " sum(extract(epoch FROM finished_at - started_at))"
        " FROM agentruns_runs WHERE idempotency_key LIKE %s",
        (f"{batch}-%",),
    ).fetchone()
    elapsed = (last_finished - started).total_seconds()
    # When runs were stored (a worker stores a run as it takes its message): how
    # long the slots took to fill, and when the last run could start.
    stored = [
        (row[0] - started).total_seconds()
        for row in conn.execute(
            "SELECT created_at FROM agentruns_runs WHERE idempotency_key LIKE %s"
            " ORDER BY created_at",
            (f"{batch}-%",),
        )
    ]
    slots = sizes.workers * sizes.concurrency
    worker_cpu = sum((w.cpu_seconds() or 0.0) - b for w, b in zip(workers, cpu_before, strict=True))
    services = cpu_by_command()
    busy_after = machine_busy_seconds()

    def service_ms_per_run(command: str) -> float:
        used = services.get(command, 0.0) - services_before.get(command, 0.0)
        return used * 1000 / sizes.runs

    return {
        "seconds": elapsed,
        "runs_per_s": sizes.runs / elapsed,
        "dispatch_send_s": sent_s,
        "first_stored_after_s": stored[0],
        "slots_filled_after_s": stored[min(slots, len(stored)) - 1],
        "last_stored_after_s": stored[-1],
        "run_latency_p50_s": latency[0],
        "run_latency_p95_s": latency[1],
        # Stored until first claimed: time in the broker queue and the worker's prefetch.
        "queued_p50_s": wait[0],
        "queued_p95_s": wait[1],
        "execution_s_mean": float(busy) / sizes.runs,
        # Runs executing at once, on average over the batch (200 would be ideal).
        "running_mean": float(busy) / elapsed,
        # CPU per run: the two workers (engine and Celery) and this producer's sends;
        # Postgres and Redis come on top, on the same 2 cores.
        "worker_cpu_ms_per_run": worker_cpu * 1000 / sizes.runs,
        "producer_cpu_ms_per_run": producer_cpu * 1000 / sizes.runs,
        # Postgres backends that exited meanwhile are not counted: a lower bound.
        "postgres_cpu_ms_per_run": service_ms_per_run("postgres"),
        "redis_cpu_ms_per_run": service_ms_per_run("redis-server"),
        # The share of both cores in use, from the first send until all completed
        # (and the poll after): near 1.0 means the machine itself is the limit.
        "machine_busy": (busy_after[0] - busy_before[0]) / (busy_after[1] - busy_before[1]),
    }


def measure(repeat: int, quick: bool) -> list[Figure]:
    sizes = QUICK if quick else Sizes()
    batches: list[dict[str, Any]] = []
    controls: list[dict[str, Any]] = []
    with fresh_database() as url, celery_queue() as queue:
        try:
            with cluster(url, queue, slots=str(sizes.concurrency)) as group:
                names = [f"w{i + 1}" for i in range(sizes.workers)]
                workers = group.workers(*names, concurrency=sizes.concurrency)
                producer_app(queue)
                with psycopg.connect(plain(url), autocommit=True) as conn:
                    try:
                        # Warm up, unmeasured: every worker thread's first task opens
                        # its database and Redis connections and prepares statements.
                        warm = Sizes(runs=sizes.workers * sizes.concurrency)
                        one_batch(conn, queue, "warm", warm, workers)
                        for r in range(repeat):
                            batches.append(one_batch(conn, queue, f"b{r}", sizes, workers))
                            controls.append(
                                one_batch(
                                    conn, queue, f"c{r}", sizes, workers, agents.one_step.name
                                )
                            )
                    except Exception as exc:
                        raise RuntimeError(f"{exc}\n{group.tail()}") from exc
        finally:
            with psycopg.connect(plain(url), autocommit=True) as conn:
                forget_leases([r[0] for r in conn.execute("SELECT id FROM agentruns_runs")])
    rates = [b["runs_per_s"] for b in batches]
    rate = median(rates)
    ideal = ideal_rate(sizes)
    control_rates = [b["runs_per_s"] for b in controls]
    best = ceiling(sizes)
    detail = {
        "runs": sizes.runs,
        "workers": sizes.workers,
        "concurrency": sizes.concurrency,
        "ideal_runs_per_s": ideal,
        "ceiling_efficiency": best,
        "warmup_runs": sizes.workers * sizes.concurrency,
        "runs_per_s": spread(rates),
        "batches": batches,
    }
    return [
        Figure(
            id="4a",
            name=f"Celery throughput, {sizes.runs} runs of S = {agents.THROUGHPUT_STEPS}",
            unit="runs/s",
            value=rate,
            detail=detail,
        ),
        Figure(
            id="4",
            name=f"Celery efficiency (runs/s ÷ {ideal:.0f})",
            unit="",
            value=rate / ideal,
            target=0.7,
            bound="min",
            detail={"per_repeat": [r / ideal for r in rates]},
        ),
        Figure(
            id="4b",
            name="  control: the same second per run in one model call",
            unit="",
            value=median(control_rates) / ideal,
            note="one model call of 1 s per run instead of five of 200 ms: the engine stores"
            f" each run claimed and writes once, so what this misses of {best:.2f}"
            " (no overhead at all, in whole rounds of the slots) is Celery's and this machine's",
            detail={"per_repeat": [r / ideal for r in control_rates], "batches": controls},
        ),
    ]
