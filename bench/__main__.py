"""``python -m bench [--json] [--only 1,2,3] [--repeat N] [--quick]``: the figures of SPEC §11."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable

from bench.report import Figure, table

FIGURES = ("1", "2", "3", "4", "5")
NAMES = {
    "1": "engine overhead per model step, S = 20",
    "2": "history scaling S = 300 / S = 20",
    "3": "bytes stored per step, S = 300",
    "4": "Celery throughput efficiency",
    "5": "recovery after kill -9",
}
Measure = Callable[[set[str], int, bool], list[Figure]]
# machine()'s Python sum on an unloaded modern core: the figures' CPU shares scale with it.
FAST_CORE_SUM_S = "0.12-0.15"


def _groups() -> list[tuple[set[str], Measure]]:
    # Imported here so that `--help` is instant and one broken module spoils only its figures.
    def overhead(ids: set[str], repeat: int, quick: bool) -> list[Figure]:
        from bench import overhead

        return overhead.measure(ids, repeat, quick)

    def storage(ids: set[str], repeat: int, quick: bool) -> list[Figure]:
        from bench import storage

        return storage.measure(repeat, quick)

    def throughput(ids: set[str], repeat: int, quick: bool) -> list[Figure]:
        from bench import throughput

        return throughput.measure(repeat, quick)

    def recovery(ids: set[str], repeat: int, quick: bool) -> list[Figure]:
        from bench import recovery

        return recovery.measure(repeat, quick)

    return [({"1", "2"}, overhead), ({"3"}, storage), ({"4"}, throughput), ({"5"}, recovery)]


def machine() -> dict[str, float | int | None]:
    """How busy and how fast this machine is, for reading the figures."""
    start = time.process_time()
    sum(range(10_000_000))
    return {
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "python_sum_1e7_cpu_s": round(time.process_time() - start, 3),
    }


def _parse_only(value: str) -> set[str]:
    ids = {part.strip() for part in value.split(",") if part.strip()}
    unknown = ids - set(FIGURES)
    if unknown:
        raise argparse.ArgumentTypeError(f"no figure {', '.join(sorted(unknown))}: use 1-5")
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--only", type=_parse_only, default=set(FIGURES), help="figures to run, e.g. 1,2,3"
    )
    parser.add_argument(
        "--repeat", type=int, default=None, help="repeats per figure (default 3, --quick 1)"
    )
    parser.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    args = parser.parse_args(argv)
    repeat = args.repeat or (1 if args.quick else 3)
    if repeat < 1:
        parser.error("--repeat must be at least 1")
    logging.basicConfig(format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    log = logging.getLogger("bench")
    log.setLevel(logging.INFO if args.verbose else logging.WARNING)

    figures: list[Figure] = []
    before = machine()
    started = time.monotonic()
    for ids, measure in _groups():
        wanted = ids & args.only
        if not wanted:
            continue
        log.info("figures %s ...", ",".join(sorted(wanted)))
        try:
            figures += measure(wanted, repeat, args.quick)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            figures += [Figure(id=i, name=NAMES[i], unit="", note=reason) for i in sorted(wanted)]
    elapsed = time.monotonic() - started
    after = machine()

    if args.json:
        doc = {
            "repeat": repeat,
            "quick": args.quick,
            "seconds": round(elapsed, 1),
            "machine_before": before,
            "machine_after": after,
            "figures": [f.as_json() for f in figures],
        }
        print(json.dumps(doc, indent=2))
    else:
        print(table(figures))
        print(
            f"\n({'quick, ' if args.quick else ''}{repeat} repeat(s), {elapsed:.0f} s;"
            f" load average {before['load_avg_1m']} before, {after['load_avg_1m']} after,"
            f" on {before['cpus']} CPUs; a Python sum of 10^7 integers took"
            f" {before['python_sum_1e7_cpu_s']} s of CPU before, {after['python_sum_1e7_cpu_s']}"
            f" s after, {FAST_CORE_SUM_S} s on an unloaded modern core)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
