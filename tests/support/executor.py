"""A helper process: one engine executing one run, to be killed or stopped by a test.

    python -m tests.support.executor DB_URL REDIS_PREFIX RUN_ID [LEASE_TTL]

Errors reported to ``on_error`` are logged as ``error <ClassName>`` lines.
``AGENTRUNS_TEST_CLOCK_AHEAD`` (seconds) sets agentruns' clock that far ahead in
this process, as on a host whose clock is off.
"""

from __future__ import annotations

import os
import sys
from datetime import datetime, timedelta

from agentruns import Engine, RedisLeases, SqlStore
from agentruns.schedulers import ManualScheduler
from tests.conftest import REDIS_URL
from tests.support.agents import AGENTS, log


def _clock_ahead(seconds: float) -> None:
    """Every agentruns module's ``utcnow``, ``seconds`` ahead."""
    from agentruns import runs

    real = runs.utcnow

    def ahead() -> datetime:
        return real() + timedelta(seconds=seconds)

    for name, module in list(sys.modules.items()):
        if name.startswith("agentruns") and getattr(module, "utcnow", None) is real:
            module.utcnow = ahead  # type: ignore[attr-defined]


def main() -> None:
    if os.environ.get("AGENTRUNS_TEST_CLOCK_AHEAD"):
        _clock_ahead(float(os.environ["AGENTRUNS_TEST_CLOCK_AHEAD"]))
    db_url, prefix, run_id = sys.argv[1:4]
    lease_ttl = float(sys.argv[4]) if len(sys.argv) > 4 else 1.0
    engine = Engine(
        SqlStore(db_url),
        leases=RedisLeases(REDIS_URL, prefix=prefix),
        scheduler=ManualScheduler(),
        agents=AGENTS,
        secret="test-secret",
        lease_ttl=lease_ttl,
        on_error=lambda exc: log(f"error {type(exc).__name__}"),
    )
    log(f"executor started {run_id}")
    run = engine.execute(run_id)
    log(f"executor finished {run.status.value}")
    engine.close()


if __name__ == "__main__":
    main()
