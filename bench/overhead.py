"""Figures 1 and 2: engine time per model step at S = 20 and S = 300, in one process.

Runs are dispatched first (a scheduler that only records), then each is
executed here with ``engine.execute``; a figure is the time of the execution
divided by S, median over runs, then median over repeats. The S = 20 and
S = 300 batches alternate, so the ratio compares neighbours in time on a
shared machine.

Figure 1b is figure 1 on connections with ``synchronous_commit=off``: the same
statements without waiting for the WAL flush, i.e. the engine's own cost
(Python, round trips, Postgres CPU) apart from the disk. The detail also
holds this machine's commit latency (measured around the batches), the time
of a trivial SELECT, and the SQL statements and Redis commands per step.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from agentruns import Agent, Engine, RedisLeases, SqlStore
from agentruns.models.base import Model, ModelRequest, ModelResponse
from agentruns.schedulers import ManualScheduler
from agentruns.store.postgres import COMMIT_ONE, COMMIT_ONE_LAZY
from bench import workload
from bench.probes import Counter, commit_latency_ms, round_trip_ms
from bench.report import Figure, median, spread
from bench.services import REDIS_URL, fresh_database, redis_prefix

SHORT, LONG = 20, 300
NO_FSYNC = {"connect_args": {"options": "-c synchronous_commit=off"}}


@dataclass
class Sizes:
    short_runs: int = 30
    long_runs: int = 5
    warmup: int = 3


QUICK = Sizes(short_runs=8, long_runs=2, warmup=1)


class TimedModel:
    """The agent's model, with the time spent inside it (to tell the model's share apart)."""

    def __init__(self, inner: Model) -> None:
        self.inner = inner
        self.seconds = 0.0

    @property
    def name(self) -> str:
        return self.inner.name

    def complete(self, request: ModelRequest, signal: threading.Event) -> ModelResponse:
        start = time.perf_counter()
        try:
            return self.inner.complete(request, signal)
        finally:
            self.seconds += time.perf_counter() - start


@dataclass
class Batch:
    total_ms: list[float] = field(default_factory=list)  # per step, one per run
    model_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)  # this process's CPU (not Postgres')

    @property
    def median(self) -> float:
        return median(self.total_ms)


def _timed_agent(steps: int) -> Agent:
    agent = workload.agent(f"bench_s{steps}", steps)
    agent.model = TimedModel(agent.model)
    return agent


def run_batch(engine: Engine, agent: Agent, steps: int, runs: int) -> Batch:
    timed: Any = agent.model
    ids = [engine.dispatch(agent.name, workload.trigger(i)).id for i in range(runs)]
    batch = Batch()
    for run_id in ids:
        timed.seconds = 0.0
        cpu = time.process_time()
        start = time.perf_counter()
        engine.execute(run_id)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu
        workload.check_completed(engine, run_id, steps)
        batch.total_ms.append(elapsed * 1000 / steps)
        batch.model_ms.append(timed.seconds * 1000 / steps)
        batch.cpu_ms.append(cpu * 1000 / steps)
    return batch


def _engine(
    url: str, prefix: str, agents: list[Agent], errors: list[Exception], **db: Any
) -> Engine:
    return Engine(
        SqlStore(url, **db),
        leases=RedisLeases(REDIS_URL, prefix=prefix),
        scheduler=ManualScheduler(),
        agents=agents,
        secret="bench",
        on_error=errors.append,
    )


def _round_trips(engine: Engine, agent: Agent, steps: int) -> dict[str, Any]:
    counter = Counter(engine, engine.leases)  # type: ignore[arg-type]
    try:
        run_batch(engine, agent, steps, 3)
        return counter.per_step(3 * steps)
    finally:
        counter.remove()


def measure(ids: set[str], repeat: int, quick: bool) -> list[Figure]:
    sizes = QUICK if quick else Sizes()
    want_long = "2" in ids
    short_agent, long_agent = _timed_agent(SHORT), _timed_agent(LONG)
    agents = [short_agent, long_agent]
    errors: list[Exception] = []
    shorts: list[Batch] = []
    longs: list[Batch] = []
    no_fsync: list[Batch] = []
    commit_ms: list[float] = []
    with fresh_database() as url, redis_prefix() as prefix:
        engine = _engine(url, prefix, agents, errors)
        fast = _engine(url, prefix, agents, errors, **NO_FSYNC)
        try:
            # Warm up: connections, statement caches, imports.
            run_batch(engine, short_agent, SHORT, sizes.warmup)
            if "1" in ids:
                run_batch(fast, short_agent, SHORT, sizes.warmup)
            if want_long:
                run_batch(engine, long_agent, LONG, 1)
            for _ in range(repeat):
                commit_ms.append(commit_latency_ms(url))
                shorts.append(run_batch(engine, short_agent, SHORT, sizes.short_runs))
                if want_long:
                    longs.append(run_batch(engine, long_agent, LONG, sizes.long_runs))
                if "1" in ids:
                    no_fsync.append(run_batch(fast, short_agent, SHORT, sizes.short_runs))
            commit_ms.append(commit_latency_ms(url))
            select_ms = round_trip_ms(url)
            trips = {f"S={SHORT}": _round_trips(engine, short_agent, SHORT)}
            if want_long:
                trips[f"S={LONG}"] = _round_trips(engine, long_agent, LONG)
        finally:
            engine.close()
            fast.close()
    if errors:
        raise RuntimeError(f"the engine reported errors: {errors[:3]}")

    short_ms = [b.median for b in shorts]
    # For scale: a step is two statements, one of them waiting for the WAL flush.
    context = {
        "commit_latency_ms": spread(commit_ms),
        "select_round_trip_ms": select_ms,
        "round_trips_per_step": trips,
    }
    figures = []
    if "1" in ids:
        short_detail = {**_batches_detail(shorts, sizes.short_runs), **context}
        figures += [
            Figure(
                id="1",
                name=f"engine overhead per model step, S = {SHORT}",
                unit="ms",
                value=median(short_ms),
                target=0.5,
                note=_floor_note(
                    trips[f"S={SHORT}"]["hot_statement_ms"],
                    median(commit_ms),
                    select_ms,
                    short_detail["process_cpu_ms_per_step"],
                ),
                detail=short_detail,
            ),
            Figure(
                id="1b",
                name="  the same with synchronous_commit=off",
                unit="ms",
                value=median([b.median for b in no_fsync]),
                detail={
                    "per_repeat_ms": [b.median for b in no_fsync],
                    "process_cpu_ms_per_step": median([median(b.cpu_ms) for b in no_fsync]),
                },
            ),
        ]
    if want_long:
        long_ms = [b.median for b in longs]
        ratios = [lg / sh for lg, sh in zip(long_ms, short_ms, strict=True)]
        # The cost of one more step, without the per-run part (claim, load, settle).
        marginal = [
            (lg * LONG - sh * SHORT) / (LONG - SHORT)
            for lg, sh in zip(long_ms, short_ms, strict=True)
        ]
        figures += [
            Figure(
                id="2a",
                name=f"engine overhead per model step, S = {LONG}",
                unit="ms",
                value=median(long_ms),
                detail={
                    **_batches_detail(longs, sizes.long_runs),
                    **({} if "1" in ids else context),
                },
            ),
            Figure(
                id="2",
                name=f"history scaling: ms per step S = {LONG} / S = {SHORT}",
                unit="x",
                value=median(ratios),
                target=1.25,
                detail={"per_repeat": ratios, "marginal_ms_per_step": median(marginal)},
            ),
        ]
    return figures


def _floor_note(hot_ms: dict[str, float], commit: float, select: float, cpu: float) -> str:
    """Figure 1's floor on this machine: the two writes every step must make (SPEC §4),
    timed as the engine waits for them, beside what a trivial commit and SELECT take."""
    response, results = hot_ms[COMMIT_ONE.name], hot_ms[COMMIT_ONE_LAZY.name]
    return (
        f"a step's two writes took {response:.2f} ms (its response, durable) and"
        f" {results:.2f} ms (its tool results), {response + results:.2f} ms before the"
        f" engine's own work; a small commit took {commit:.2f} ms here meanwhile, and a"
        f" SELECT 1 {select:.2f} ms (medians); this process's CPU per step: {cpu:.2f} ms"
    )


def _batches_detail(batches: list[Batch], runs: int) -> dict[str, Any]:
    """What one figure's repeats were made of: per repeat, per run, model and CPU shares."""
    return {
        "per_repeat_ms": [b.median for b in batches],
        "runs_per_repeat": runs,
        "all_runs_ms": spread([x for b in batches for x in b.total_ms]),
        "model_ms_per_step": median([median(b.model_ms) for b in batches]),
        "process_cpu_ms_per_step": median([median(b.cpu_ms) for b in batches]),
    }
