"""Where an execution's time goes: ``python -m bench.profile [--steps 20] [--runs 10]``.

Counts the SQL statements, commits and Redis commands per model step (from
SQLAlchemy and redis-py hooks), times the Postgres commit of a small row on
this machine for scale, and profiles the executions: by default cProfile on
CPU time (on a shared machine, wall-clock samples land wherever the process
was descheduled); ``--pyinstrument`` for a wall-clock call tree
(``pip install pyinstrument``; a dev tool, not a dependency).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from typing import Any

from agentruns import Engine, RedisLeases, SqlStore
from agentruns.schedulers import ManualScheduler
from bench import workload
from bench.probes import Counter, commit_latency_ms
from bench.services import REDIS_URL, fresh_database, redis_prefix


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--no-profile", action="store_true", help="only count round trips")
    parser.add_argument("--pyinstrument", action="store_true", help="a wall-clock call tree")
    parser.add_argument("--top", type=int, default=40, help="functions to list (cProfile)")
    parser.add_argument(
        "--async-commit",
        action="store_true",
        help="synchronous_commit=off on the database: the engine's CPU without the fsyncs",
    )
    args = parser.parse_args()
    agent = workload.agent(f"bench_s{args.steps}", args.steps)
    with fresh_database() as url, redis_prefix() as prefix:
        print(f"one small autocommit insert here: {commit_latency_ms(url):.3f} ms (median)")
        options = {"connect_args": {"options": "-c synchronous_commit=off"}}
        leases = RedisLeases(REDIS_URL, prefix=prefix)
        engine = Engine(
            SqlStore(url, **(options if args.async_commit else {})),
            leases=leases,
            scheduler=ManualScheduler(),
            agents=[agent],
            secret="bench",
        )
        counter = Counter(engine, leases)
        try:
            warm = [engine.dispatch(agent.name, workload.trigger(i)).id for i in range(2)]
            for run_id in warm:
                engine.execute(run_id)
            ids = [engine.dispatch(agent.name, workload.trigger(i)).id for i in range(args.runs)]
            counter.reset()
            profiler: Any = None
            if args.pyinstrument:
                from pyinstrument import Profiler

                profiler = Profiler(interval=0.0002)
                profiler.start()
            elif not args.no_profile:
                profiler = cProfile.Profile(time.process_time)
                profiler.enable()
            start = time.perf_counter()
            cpu = time.process_time()
            for run_id in ids:
                engine.execute(run_id)
            elapsed = time.perf_counter() - start
            cpu = time.process_time() - cpu
            if args.pyinstrument:
                profiler.stop()
            elif profiler is not None:
                profiler.disable()
            for run_id in ids:
                workload.check_completed(engine, run_id, args.steps)
            steps = args.runs * args.steps
            print(
                f"{elapsed * 1000 / steps:.3f} ms per model step over {steps} steps,"
                f" {cpu * 1000 / steps:.3f} ms of it this process's CPU"
                + ("" if profiler is None else " (inflated by the profiler)")
            )
            counts = counter.per_step(steps)
            print(f"SQL statements per step: {counts['sql_statements']:.2f}", end="")
            print(f" ({counts['sql_writes']:.2f} writes,", end="")
            print(f" {counts['explicit_commits']:.2f} explicit COMMITs)")
            for shape, n in counts["sql_by_statement"].items():
                print(f"  {n:6.2f}  {shape}")
            print(f"Redis commands per step: {counts['redis_commands']:.2f}")
            for command, n in counts["redis_by_command"].items():
                print(f"  {n:6.2f}  {command}")
            if args.pyinstrument:
                print(profiler.output_text(unicode=True, color=False, show_all=False))
            elif profiler is not None:
                stats = pstats.Stats(profiler)
                stats.sort_stats("cumulative").print_stats(args.top)
                stats.sort_stats("tottime").print_stats(args.top // 2)
        finally:
            engine.close()


if __name__ == "__main__":
    main()
