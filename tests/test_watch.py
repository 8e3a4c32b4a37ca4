"""`agentruns watch` follows runs live over Redis pub/sub when Redis is configured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from agentruns import Agent, RedisLeases, RunStatus
from agentruns.models import ScriptedModel, text
from agentruns.schedulers import ManualScheduler
from agentruns.settings import Settings
from agentruns.wiring import engine_from_settings
from tests.conftest import REDIS_URL, trigger

ROOT = Path(__file__).resolve().parent.parent


def test_watch_wakes_on_published_events_instead_of_waiting_for_its_poll(
    sqlite_url: str,
) -> None:
    settings = Settings(database_url=sqlite_url, redis_url=REDIS_URL, agents="", secret="s")
    engine = engine_from_settings(
        settings,
        agents=[Agent("a", ScriptedModel([text("ok")], latency_s=0.2))],
        scheduler=ManualScheduler(),
        leases=RedisLeases(REDIS_URL, prefix=f"watch-{os.getpid()}"),
    )
    run = engine.dispatch("a", trigger({}))
    env = {
        **os.environ,
        "AGENTRUNS_DATABASE_URL": sqlite_url,
        "AGENTRUNS_REDIS_URL": REDIS_URL,
        "PYTHONPATH": str(ROOT),
    }
    # A poll interval far longer than the test: only a published event can wake it.
    watcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentruns.cli",
            "--json",
            "watch",
            "--run",
            run.id,
            "--until-final",
            "--interval",
            "60",
        ],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert watcher.stdout is not None
        first = json.loads(watcher.stdout.readline())
        assert first["event"] == "run.updated" and first["run"]["status"] == "queued"
        time.sleep(1.0)  # let it subscribe, and the publisher see it
        started = time.monotonic()
        assert engine.execute(run.id).status is RunStatus.COMPLETED
        out, _ = watcher.communicate(timeout=15)
        assert time.monotonic() - started < 15
        events = [json.loads(line) for line in out.splitlines()]
        assert events[-1]["event"] == "run.updated"
        assert events[-1]["run"]["status"] == "completed"
        assert any(e["event"] == "step.appended" for e in events)
        assert watcher.returncode == 0
    finally:
        if watcher.poll() is None:
            watcher.kill()
        engine.close()
