"""Real ``celery -A agentruns`` worker and beat processes: figures 4 and 5, and the Celery tests.

Workers and beat get ``AGENTRUNS_*`` settings pointing at the benchmark's own
database and at a queue of its own (``AGENTRUNS_QUEUE``), and import the
benchmark agents (``AGENTRUNS_AGENTS=bench.agents``). Every process is
stopped at the end, and the queue's keys are removed from Redis.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import redis

from bench.services import REDIS_URL

ROOT = Path(__file__).resolve().parents[1]
CELERY = str(Path(sys.executable).parent / "celery")
SECRET = "bench-secret"
T = TypeVar("T")


def wait_for(check: Callable[[], T | None], what: str, timeout: float, every: float = 0.02) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def cpu_seconds(self) -> float | None:
        """User + system CPU the process has used so far (Linux), else None."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_env(database_url: str, queue: str, **settings: str) -> dict[str, str]:
    """The environment of the benchmark's workers: its database, queue and agents."""
    return {
        **os.environ,
        "AGENTRUNS_DATABASE_URL": database_url,
        "AGENTRUNS_REDIS_URL": REDIS_URL,
        "AGENTRUNS_BROKER_URL": REDIS_URL,
        "AGENTRUNS_QUEUE": queue,
        "AGENTRUNS_AGENTS": "bench.agents",
        "AGENTRUNS_SECRET": SECRET,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **{f"AGENTRUNS_{k.upper()}": v for k, v in settings.items()},
    }


class Cluster:
    """Celery processes on one queue, for the benchmarks and the Celery tests alike.

    ``env`` is every process's environment (``AGENTRUNS_*`` included); each
    process logs to ``logdir``; ``stop()`` ends every one of them.
    """

    def __init__(
        self,
        env: dict[str, str],
        queue: str,
        logdir: Path,
        cwd: Path = ROOT,
        app: str = "agentruns",
    ) -> None:
        self.app = app  # the Celery app (-A) its processes run
        self.queue = queue
        self.logdir = logdir
        self.env = env
        self.cwd = cwd  # where celeryconfig.py is found
        self.procs: list[Proc] = []

    def _start(self, name: str, args: list[str]) -> Proc:
        log = self.logdir / f"{name}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                [CELERY, "-A", self.app, *args],
                cwd=self.cwd,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def workers(
        self,
        *names: str,
        pool: str = "threads",
        concurrency: int = 8,
        options: Sequence[str] = (),
    ) -> list[Proc]:
        """Start workers (with more command-line ``options``); wait until each consumes."""
        procs = [
            self._start(
                name,
                [
                    "worker",
                    "-P",
                    pool,
                    "-c",
                    str(concurrency),
                    "-n",
                    f"{name}-{self.queue}@%h",
                    # Start without waiting on other workers' replies.
                    "--without-mingle",
                    "--without-gossip",
                    "--without-heartbeat",
                    "-l",
                    "INFO",
                    *options,
                ],
            )
            for name in names
        ]
        for proc in procs:
            wait_for(lambda p=proc: self._ready(p), f"worker {proc.name} to be ready", 60)  # type: ignore[misc]
        return procs

    def _ready(self, proc: Proc) -> bool:
        if not proc.alive():
            raise RuntimeError(f"worker {proc.name} exited:\n{proc.output()[-3000:]}")
        return " ready." in proc.output()

    def beat(self) -> Proc:
        proc = self._start("beat", ["beat", "-s", str(self.logdir / "beat-schedule"), "-l", "INFO"])

        def started() -> bool:
            if not proc.alive():
                raise RuntimeError(f"beat exited:\n{proc.output()[-3000:]}")
            return "beat: Starting" in proc.output()

        wait_for(started, "beat to start", 30)
        return proc

    def by_pid(self, pid: int) -> Proc:
        for proc in self.procs:
            if proc.pid == pid:
                return proc
        raise RuntimeError(f"pid {pid} is none of this cluster's processes")

    def stop(self, *, graceful: bool = True) -> None:
        """Warm shutdown (SIGTERM: workers drain), or SIGKILL when not ``graceful``."""
        for proc in self.procs:
            if proc.alive():
                proc.popen.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
        deadline = time.monotonic() + 15
        for proc in self.procs:
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=10)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(
            f"----- {p.name} (pid {p.pid}) -----\n" + "\n".join(p.output().splitlines()[-lines:])
            for p in self.procs
        )


@contextlib.contextmanager
def cluster(database_url: str, queue: str, **settings: str) -> Iterator[Cluster]:
    with tempfile.TemporaryDirectory(prefix="agentruns-bench-") as logdir:
        group = Cluster(bench_env(database_url, queue, **settings), queue, Path(logdir))
        try:
            yield group
        finally:
            group.stop()


@contextlib.contextmanager
def celery_queue() -> Iterator[str]:
    """A queue of its own; its messages and bindings (acked or not) go at the end."""
    name = f"agentruns-bench-{uuid.uuid4().hex[:10]}"
    try:
        yield name
    finally:
        forget_queue(name)


def forget_queue(name: str, redis_url: str = REDIS_URL) -> None:
    """Remove a queue's keys, and its messages a killed worker left unacked, from the
    benchmark's Redis or ``redis_url`` (the tests')."""
    client = redis.Redis.from_url(redis_url)
    try:
        patterns = (f"{name}*", f"_kombu.binding.{name}*", f"_kombu.binding_permanent.{name}*")
        keys = [key for pattern in patterns for key in client.scan_iter(pattern)]
        if keys:
            client.delete(*keys)
        # A killed worker's unacked message would come back after the visibility timeout.
        for tag, raw in client.hscan_iter("unacked"):
            try:
                _, exchange, routing_key = json.loads(raw)
            except (ValueError, TypeError):
                continue
            if any(str(part).startswith(name) for part in (exchange, routing_key)):
                client.hdel("unacked", tag)
                client.zrem("unacked_index", tag)
    finally:
        client.close()


def forget_leases(run_ids: list[str], prefix: str = "agentruns") -> None:
    """The workers' lease keys (default prefix) of the benchmark's runs."""
    if not run_ids:
        return
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.delete(*[f"{prefix}:lease:{run_id}" for run_id in run_ids])
    finally:
        client.close()


def producer_app(queue: str) -> Any:
    """``agentruns.celery.app`` sending to the benchmark's broker and queue."""
    from agentruns.settings import get_settings

    os.environ.update(
        {
            "AGENTRUNS_REDIS_URL": REDIS_URL,
            "AGENTRUNS_BROKER_URL": REDIS_URL,
            "AGENTRUNS_QUEUE": queue,
            "AGENTRUNS_AGENTS": "bench.agents",
        }
    )
    get_settings.cache_clear()
    from agentruns.celery import app

    app.conf.update(broker_url=REDIS_URL, task_default_queue=queue)
    return app
