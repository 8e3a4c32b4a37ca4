"""Real ``celery -A agentruns worker`` processes (threads pool) on the real Redis and Postgres.

Each test starts its own workers (and beat, where it says so) on a queue of
its own for this session, so several test sessions can share one Redis. The
test process is a producer (``dispatch.delay()``) and, where a test says so,
an engine with a ``CeleryScheduler`` that calls ``recover()`` itself.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from celery.exceptions import ImproperlyConfigured

from agentruns import (
    CeleryScheduler,
    Engine,
    InvalidTriggerError,
    RedisLeases,
    Run,
    RunStatus,
    SqlStore,
)
from agentruns import worker as worker_module
from agentruns.celery import CLOCK_SKEW_S, defaults, sweeps_queue
from agentruns.errors import InvalidAnswerError
from agentruns.migrate import migrate
from agentruns.runs import RunError, utcnow
from agentruns.schedulers import ManualScheduler
from agentruns.settings import get_settings
from agentruns.store.base import Commit, Guard
from bench.cluster import Cluster as BaseCluster
from bench.cluster import Proc, forget_queue
from tests.conftest import REDIS_URL, EngineFactory, trigger, wait_for
from tests.support import celery_agents
from tests.support.celery_agents import CHARGE_SCRIPT, QUICK_SCRIPT
from tests.support.proxy import Proxy

ROOT = Path(__file__).resolve().parents[1]
LEASE_TTL = 1.0
REQUEUE_AFTER = 2.0
T = TypeVar("T")


# -- the session's queue and the producer ------------------------------------------------


@pytest.fixture(scope="session")
def queue() -> Iterator[str]:
    """A queue of this session's own; its keys (and messages left unacked) go at the end."""
    name = f"agentruns-test-{uuid.uuid4().hex[:10]}"
    yield name
    forget_queue(name, REDIS_URL)


@pytest.fixture(scope="session")
def celery_app(queue: str) -> Iterator[Any]:
    """``agentruns.celery.app``, pointed at the test broker and queue (for ``.delay()``)."""
    env = {
        "AGENTRUNS_REDIS_URL": REDIS_URL,
        "AGENTRUNS_BROKER_URL": REDIS_URL,
        "AGENTRUNS_QUEUE": queue,
    }
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        get_settings.cache_clear()
        from agentruns.celery import app

        # If another test configured the app first, the environment alone is not enough.
        before = {
            "broker_url": app.conf.broker_url,
            "task_default_queue": app.conf.task_default_queue,
            "task_routes": app.conf.task_routes,
        }
        # The routes too: a cancel goes to the sweeps queue beside the runs'. (Celery
        # keeps the routes it read, and a router made of them.)
        routes = defaults()["task_routes"]
        app.conf.update(broker_url=REDIS_URL, task_default_queue=queue, task_routes=routes)
        _reroute(app)
        yield app
        app.conf.update(before)
        _reroute(app)
    get_settings.cache_clear()


def _reroute(app: Any) -> None:
    app.amqp.flush_routes()
    app.amqp.__dict__.pop("router", None)


# -- worker and beat processes -----------------------------------------------------------


class Cluster(BaseCluster):
    """The workers (and beat) of one test; every one is killed at the end, pass or fail."""

    def __init__(self, tmp_path: Path, env: dict[str, str], queue: str) -> None:
        super().__init__(env, queue, tmp_path)
        self.tool_log = Path(env["AGENTRUNS_TEST_LOG"])

    def workers(
        self,
        *names: str,
        beat: bool = False,
        pool: str = "threads",
        concurrency: int = 8,
        options: Sequence[str] = (),
    ) -> list[Proc]:
        """Start workers (and beat); return once every one has started."""
        procs = super().workers(*names, pool=pool, concurrency=concurrency, options=options)
        if beat:
            self.beat()
        return procs

    def holder(self, run_id: str, leases: RedisLeases) -> Proc:
        """The worker whose engine holds the run's lease (owner is ``host:pid:random``)."""
        owner = wait_for(lambda: leases.holder(run_id), f"a lease on {run_id}")
        pid = int(owner.split(":")[-2])
        return self.by_pid(pid)

    def tool_calls(self, tool: str, run_id: str | None = None) -> list[int]:
        """The pids of the processes that called ``tool`` (for ``run_id``), in order."""
        if not self.tool_log.exists():
            return []
        calls = []
        for line in self.tool_log.read_text().splitlines():
            name, run, pid = line.split()
            if name == tool and run_id in (None, run):
                calls.append(int(pid))
        return calls


@pytest.fixture
def cluster(tmp_path: Path, db_url: str, queue: str, celery_app: Any) -> Iterator[Cluster]:
    env = {
        **os.environ,
        "AGENTRUNS_DATABASE_URL": db_url,
        "AGENTRUNS_REDIS_URL": REDIS_URL,
        "AGENTRUNS_BROKER_URL": REDIS_URL,
        "AGENTRUNS_QUEUE": queue,
        "AGENTRUNS_AGENTS": "tests.support.celery_agents",
        "AGENTRUNS_SECRET": "test-secret",
        "AGENTRUNS_LEASE_TTL": str(LEASE_TTL),
        "AGENTRUNS_REQUEUE_AFTER": str(REQUEUE_AFTER),
        "AGENTRUNS_TICK_INTERVAL": "1",
        "AGENTRUNS_RECOVER_INTERVAL": "1",
        "AGENTRUNS_TEST_LOG": str(tmp_path / "tools.log"),
        "PYTHONPATH": str(ROOT),
    }
    group = Cluster(tmp_path, env, queue)
    try:
        yield group
    finally:
        group.stop(graceful=False)
        for proc in group.procs:  # shown by pytest when the test failed
            print(f"----- {proc.name} (pid {proc.pid}) -----\n{proc.output()[-6000:]}")


@pytest.fixture
def leases() -> Iterator[RedisLeases]:
    """The workers' leases (the default prefix), to see who holds a run."""
    instance = RedisLeases(REDIS_URL)
    yield instance
    instance.close()


@pytest.fixture
def engine(make_engine: EngineFactory, celery_app: Any) -> Engine:
    """An engine in the test process whose executions go to the workers."""
    return make_engine(
        [
            celery_agents.quick,
            celery_agents.charger,
            celery_agents.reporter,
            celery_agents.waiter,
            celery_agents.asker,
            celery_agents.self_approver,
            celery_agents.decliner,
        ],
        scheduler=CeleryScheduler(celery_app),
        leases=RedisLeases(REDIS_URL),
        lease_ttl=LEASE_TTL,
        requeue_after=REQUEUE_AFTER,
    )


def assert_replayed_once(engine: Engine, run: Run, script: list[Any]) -> None:
    """Dense steps, and exactly one saved model call per response of the script."""
    steps = engine.steps(run.id)
    assert [s.index for s in steps] == list(range(len(steps)))
    assert [s.kind for s in steps].count("llm") == len(script)
    assert run.steps_used == len(script)


RESUMABLE = (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.INTERRUPTED)


def completed(engine: Engine, run_id: str) -> Run | None:
    run = engine.get_run(run_id)
    assert run.status in (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.COMPLETED), run
    return run if run.status is RunStatus.COMPLETED else None


# -- the tests --------------------------------------------------------------------------------


def test_runs_sent_one_by_one_or_in_a_batch_complete_across_two_workers(
    cluster: Cluster, engine: Engine
) -> None:
    """Half sent one by one, half in one producer batch (README, "Producers")."""
    from agentruns.tasks import dispatch

    cluster.workers("w1", "w2")
    for i in range(15):
        dispatch.delay("quick", trigger({"n": i}), idempotency_key=f"run-{i}")
    with dispatch.app.producer_or_acquire() as producer, producer.batch():
        for i in range(15, 30):
            dispatch.apply_async(
                ("quick", trigger({"n": i})), {"idempotency_key": f"run-{i}"}, producer=producer
            )
    dispatch.delay("quick", trigger({"n": 7}), idempotency_key="run-7")  # a duplicate

    def all_completed() -> list[Run] | None:
        runs = engine.list_runs(limit=100)
        done = [r for r in runs if r.status is RunStatus.COMPLETED]
        return runs if len(done) == 30 else None

    runs = wait_for(all_completed, "30 completed runs")
    time.sleep(0.3)  # a second run for the duplicate would have shown up by now
    runs = engine.list_runs(limit=100)
    assert len(runs) == 30
    assert {r.idempotency_key for r in runs} == {f"run-{i}" for i in range(30)}
    assert all(r.output == "Done." and r.claim is None for r in runs)
    for run in runs:
        assert_replayed_once(engine, run, QUICK_SCRIPT)
    notes = cluster.tool_calls("note")
    assert len(notes) == 30
    assert set(notes) == {p.pid for p in cluster.procs}  # both workers took part
    assert all(p.popen.poll() is None for p in cluster.procs)


def test_killed_worker_run_completes_elsewhere_without_manual_step(
    cluster: Cluster, engine: Engine, leases: RedisLeases
) -> None:
    from agentruns.tasks import dispatch

    cluster.workers("w1", "w2", beat=True)
    dispatch.delay("charger", trigger({"card": "4242"}), idempotency_key="kill-me")
    run = wait_for(lambda: next(iter(engine.list_runs()), None), "the run to be stored")

    # Kill the holder once the charge is recorded, while its next model call is in flight.
    wait_for(
        lambda: any(s.name == "charge" for s in engine.steps(run.id)), "the charge to be saved"
    )
    victim = cluster.holder(run.id, leases)
    os.kill(victim.pid, signal.SIGKILL)
    victim.popen.wait(timeout=5)
    (survivor,) = [p for p in cluster.procs if p.name != "beat" and p is not victim]

    # Beat's recover finds the expired claim; the survivor finishes from the checkpoint.
    done = wait_for(lambda: completed(engine, run.id), "the run to complete elsewhere")
    assert done.output == "Charged."
    assert cluster.tool_calls("charge", run.id) == [victim.pid]  # the effect ran once
    assert cluster.tool_calls("note", run.id)[-1] == survivor.pid
    assert_replayed_once(engine, done, CHARGE_SCRIPT)


def test_sigterm_drains_the_worker_and_recover_lets_another_finish(
    cluster: Cluster, engine: Engine, leases: RedisLeases
) -> None:
    from agentruns.tasks import dispatch

    cluster.workers("w1", "w2")
    dispatch.delay("charger", trigger({"card": "4242"}), idempotency_key="drain-me")
    run = wait_for(lambda: next(iter(engine.list_runs()), None), "the run to be stored")
    wait_for(lambda: engine.steps(run.id), "the first step to be saved")

    victim = cluster.holder(run.id, leases)
    stopped = time.monotonic()
    victim.popen.send_signal(signal.SIGTERM)
    assert victim.popen.wait(timeout=10) == 0
    assert time.monotonic() - stopped < 5.0

    interrupted = engine.get_run(run.id)
    assert interrupted.status is RunStatus.INTERRUPTED
    assert interrupted.claim is None
    assert leases.holder(run.id) is None
    # The task that ran it (dispatch executes the run it stores) returned: its message is acked.
    assert re.search(rf"agentruns.dispatch\[[^]]+\] succeeded in .*{run.id}", victim.output())

    assert engine.recover() == [run.id]
    (survivor,) = [p for p in cluster.procs if p is not victim]
    done = wait_for(lambda: completed(engine, run.id), "another worker to finish the run")
    assert done.output == "Charged."
    assert len(cluster.tool_calls("charge", run.id)) == 1
    assert cluster.tool_calls("note", run.id)[-1] == survivor.pid
    assert_replayed_once(engine, done, CHARGE_SCRIPT)


@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_a_cold_shutdown_drains_a_pool_that_cannot_cancel_tasks(
    cluster: Cluster, engine: Engine, leases: RedisLeases, pool: str
) -> None:
    # SIGQUIT (or SIGTERM with REMAP_SIGTERM=SIGQUIT): Celery cancels the tasks in
    # flight, which these pools cannot. In a solo pool its NotImplementedError was
    # raised inside the run itself: the model call failed the run (model_error), a
    # tool call became the tool's error. In a threads pool it ended the worker.
    (worker,) = cluster.workers("w1", pool=pool, concurrency=1)
    run = engine.dispatch("charger", trigger({"card": "4242"}))
    wait_for(lambda: len(engine.steps(run.id)) >= 3, "the charge to be saved")
    assert cluster.holder(run.id, leases) is worker

    worker.popen.send_signal(signal.SIGQUIT)
    worker.popen.wait(timeout=15)
    interrupted = engine.get_run(run.id)
    assert interrupted.status is RunStatus.INTERRUPTED, interrupted
    assert interrupted.error is None and interrupted.claim is None
    assert "does not implement kill_job" not in worker.output()
    assert not [s for s in engine.steps(run.id) if s.error is not None]

    assert engine.recover() == [run.id]
    cluster.workers("w2")
    done = wait_for(lambda: completed(engine, run.id), "another worker to finish the run")
    assert len(cluster.tool_calls("charge", run.id)) == 1
    assert_replayed_once(engine, done, CHARGE_SCRIPT)


@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_a_tool_that_exits_is_the_tools_error_in_any_pool(
    cluster: Cluster, engine: Engine, pool: str
) -> None:
    # argparse exits on bad arguments (SystemExit). In a solo pool the task runs in
    # the worker's main thread, where that was taken for a signal stopping the
    # process: the execution ended unsettled and the run stayed running until its
    # lease expired, to fail the same way after every recover(). In Celery's main
    # thread no signal raises it: the worker's handlers set flags, and only its
    # hard shutdown raises (WorkerTerminate, which still stops the run).
    cluster.workers("w1", pool=pool, concurrency=1)
    run = engine.dispatch("reporter", trigger({}))
    done = wait_for(lambda: completed(engine, run.id), "the run to complete", 20)
    assert done.output == "Reported."
    (step,) = [s for s in engine.steps(run.id) if s.kind == "tool"]
    assert step.output == {"is_error": True, "content": "SystemExit: 2"} or step.error, step


def test_a_prefork_process_terminated_in_a_tool_leaves_its_run_to_recover(
    cluster: Cluster, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """billiard's SIGTERM handler exits the process (a cold shutdown terminates the
    pool's processes so, and a hard time limit before its SIGKILL): the SystemExit it
    raises inside a tool stops the run, as a crash would, and is not the tool's error
    for the model to go on from. Nor is it a live process letting the run go: a step
    past the hard time limit was requeued at once, each time, never held back, its
    effect called again on every lap."""
    cluster.workers("w1", pool="prefork", concurrency=1)
    run = engine.dispatch("waiter", trigger({}))
    (pid,) = wait_for(lambda: cluster.tool_calls("wait_a_while", run.id), "the tool to start")
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not _alive(pid) or None, "the process to exit", 10)
    time.sleep(0.5)
    left = engine.get_run(run.id)
    assert left.status is RunStatus.RUNNING, left  # its lease runs out, then recover()
    assert [s for s in engine.steps(run.id) if s.kind == "tool"] == []

    def resumed() -> Run | None:
        engine.recover()
        return completed(engine, run.id)

    with caplog.at_level("INFO", logger="agentruns"):
        done = wait_for(resumed, "recover to finish the run", 30)
    (step,) = [s for s in engine.steps(done.id) if s.kind == "tool"]
    assert step.error is None and step.output == "waited", step
    assert f"run {run.id} requeued: its execution was lost with its worker" in caplog.text


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_in_a_workers_task_only_celerys_hard_shutdown_stops_the_main_thread(
    celery_app: Any,
) -> None:
    """Which exits in the main thread stop the task (the run left for recover())."""
    from celery._state import pop_current_task, push_current_task
    from celery.exceptions import WorkerShutdown, WorkerTerminate

    from agentruns.errors import stops_the_task

    @celery_app.task(name="agentruns.test_stop", shared=False)
    def received() -> None: ...

    @celery_app.task(name="agentruns.test_applied", shared=False)
    def applied() -> None: ...

    exits = [SystemExit(2), KeyboardInterrupt(), WorkerTerminate(1), WorkerShutdown(0)]
    # Outside a worker's task (an embedded engine, an eager task), each may be a
    # signal's, which the app's own handler raised.
    assert [stops_the_task(e) for e in exits] == [True, True, True, True]
    received.push_request(id="a-received-task", is_eager=True, called_directly=False)
    push_current_task(received)
    try:
        assert [stops_the_task(e) for e in exits] == [True, True, True, True]
        received.request.is_eager = False
        assert [stops_the_task(e) for e in exits] == [False, False, True, True]
        # A task it applies eagerly runs in it, on the worker's main thread all the same.
        applied.push_request(id="an-eager-task", is_eager=True, called_directly=False)
        push_current_task(applied)
        try:
            assert [stops_the_task(e) for e in exits] == [False, False, True, True]
        finally:
            pop_current_task()
            applied.pop_request()
    finally:
        pop_current_task()
        received.pop_request()
    # In another thread, only the code raises them.
    seen: list[bool] = []
    worker = threading.Thread(target=lambda: seen.extend(stops_the_task(e) for e in exits))
    worker.start()
    worker.join()
    assert seen == [False, False, False, False]


def test_a_remote_shutdown_drains_the_worker_as_sigterm_does(
    cluster: Cluster, engine: Engine, leases: RedisLeases, celery_app: Any, queue: str
) -> None:
    # `celery control shutdown` sends the worker no signal: before its consumer
    # drained on closing, the worker waited for its runs to finish (the charger's
    # model takes seconds per step) and the run completed there.
    (worker,) = cluster.workers("w1")
    run = engine.dispatch("charger", trigger({"card": "4242"}))
    wait_for(lambda: engine.steps(run.id), "the first step to be saved")
    assert cluster.holder(run.id, leases) is worker

    stopped = time.monotonic()
    celery_app.control.shutdown(destination=[f"w1-{queue}@{socket.gethostname()}"])
    assert worker.popen.wait(timeout=10) == 0
    assert time.monotonic() - stopped < 5.0
    interrupted = engine.get_run(run.id)
    assert interrupted.status is RunStatus.INTERRUPTED, interrupted
    assert interrupted.claim is None


def test_runs_whose_messages_were_lost_are_rescheduled_by_recover(
    cluster: Cluster, engine: Engine, queue: str
) -> None:
    runs = [engine.dispatch("quick", trigger({"n": i})) for i in range(5)]
    client = redis.Redis.from_url(REDIS_URL)
    try:
        assert client.delete(queue) == 1  # the broker loses every execute message
    finally:
        client.close()
    assert engine.recover() == []  # queued too recently to be called lost

    cluster.workers("w1")
    assert all(engine.get_run(r.id).status is RunStatus.QUEUED for r in runs)

    # Each run is requeued once it has been queued REQUEUE_AFTER seconds, by one sweep or the next.
    requeued: list[str] = []

    def all_requeued() -> bool:
        requeued.extend(engine.recover())
        return len(requeued) >= len(runs)

    wait_for(all_requeued, "recover to requeue the runs", timeout=REQUEUE_AFTER + 5)
    assert sorted(requeued) == sorted(r.id for r in runs)
    for run in runs:
        done = wait_for(partial(completed, engine, run.id), "the runs to complete")
        assert_replayed_once(engine, done, QUICK_SCRIPT)


def test_a_sweep_does_not_wait_behind_a_backlog_of_runs(
    cluster: Cluster,
    engine: Engine,
    make_engine: EngineFactory,
    queue: str,
    celery_app: Any,
    db_url: str,
) -> None:
    # A run a drain left interrupted, and a worker with one slot and a backlog of
    # runs of about 2 s each: beat's recover must not wait for the whole backlog.
    assert defaults()["task_routes"]["agentruns.recover"] == {"queue": sweeps_queue(queue)}
    quiet = make_engine([celery_agents.quick], scheduler=ManualScheduler())
    drained = quiet.dispatch("quick", trigger({"drained": True}))
    with psycopg.connect(db_url.replace("+psycopg", "")) as c:
        c.execute("UPDATE agentruns_runs SET status = 'interrupted' WHERE id = %s", (drained.id,))
    backlog = [engine.dispatch("charger", trigger({"n": i})) for i in range(5)]
    (worker,) = cluster.workers("w1", concurrency=1)
    wait_for(lambda: engine.get_run(backlog[0].id).status is RunStatus.RUNNING, "the backlog")
    celery_app.send_task("agentruns.recover", queue=sweeps_queue(queue))
    wait_for(
        lambda: engine.get_run(drained.id).status is not RunStatus.INTERRUPTED,
        "recover to requeue the drained run",
        timeout=30,
    )
    done = [engine.get_run(r.id).status for r in backlog].count(RunStatus.COMPLETED)
    assert done <= 2, f"recover ran after {done} of the backlog's 5 runs"
    # A cancel too: it waited behind the whole backlog, and came after the run was done.
    from agentruns.tasks import cancel

    assert defaults()["task_routes"]["agentruns.cancel"] == {"queue": sweeps_queue(queue)}
    cancel.delay(backlog[-1].id)
    wait_for(
        lambda: engine.get_run(backlog[-1].id).status is RunStatus.CANCELLED or None,
        "the cancel",
        timeout=30,
    )
    done = [engine.get_run(r.id).status for r in backlog].count(RunStatus.COMPLETED)
    assert done <= 3, f"the cancel came after {done} of the backlog's 5 runs"
    # It also nudges the backlog's runs, queued for longer than REQUEUE_AFTER: let it
    # finish before the queue is emptied for the tests after this one.
    wait_for(lambda: re.search(r"agentruns\.recover\[\S+\] succeeded", worker.output()), "recover")
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.delete(queue)  # the rest of the backlog, for the tests after this one
    finally:
        client.close()


def test_a_dispatch_a_killed_worker_had_not_stored_comes_back(
    tmp_path: Path, cluster: Cluster, engine: Engine, db_url: str
) -> None:
    # The worker takes the message, then is killed before it stores the run: only
    # the broker knows of it, and Redis gives it back after the visibility timeout
    # (an hour by default; this deployment's celeryconfig.py makes it 3 s).
    from agentruns.tasks import dispatch

    assert defaults()["broker_transport_options"]["unacked_restore_interval"] == 10
    conf = tmp_path / "deployment"
    conf.mkdir()
    (conf / "celeryconfig.py").write_text(
        "from agentruns.celery import defaults\n"
        "globals().update(defaults())\n"
        "broker_transport_options = {**broker_transport_options,"
        " 'visibility_timeout': 3, 'unacked_restore_interval': 1}\n"
    )
    group = BaseCluster(cluster.env, cluster.queue, tmp_path, cwd=conf)
    try:
        with psycopg.connect(db_url.replace("+psycopg", "")) as lock:
            lock.execute("LOCK TABLE agentruns_runs IN ACCESS EXCLUSIVE MODE")
            (first,) = group.workers("first")
            dispatch.apply_async(("quick", trigger({"n": 1})), {"idempotency_key": "held"})
            wait_for(lambda: "agentruns.dispatch[" in first.output(), "the worker to take it")
            time.sleep(0.3)  # now storing the run, behind the lock
            first.popen.kill()
            first.popen.wait(timeout=10)

        def held() -> list[Run]:
            return [r for r in engine.list_runs() if r.idempotency_key == "held"]

        assert held() == []
        group.workers("second")
        (run,) = wait_for(lambda: held() or None, "the dispatch to come back", 30)
        done = wait_for(partial(completed, engine, run.id), "the run to complete")
        assert done.idempotency_key == "held"
        assert_replayed_once(engine, done, QUICK_SCRIPT)
    finally:
        group.stop(graceful=False)


def test_redelivered_and_bad_messages_store_nothing_more(cluster: Cluster, engine: Engine) -> None:
    from agentruns.tasks import cancel, dispatch, execute, resume

    (worker,) = cluster.workers("w1")
    # The same message twice (a redelivery): without an idempotency key, its id is the key.
    for _ in range(2):
        dispatch.apply_async(("quick", trigger({"n": 1})), task_id="the-same-message")
    # Bad input fails its task once, with the reason, and is not retried.
    dispatch.delay("no-such-agent", trigger())
    # Not a trigger envelope: refused at .delay(), and by the worker if sent by name.
    dispatch.app.send_task("agentruns.dispatch", ("quick", {"payload": 1}))
    # An empty trigger id: the message's id was taken for the key, and a run stored.
    dispatch.app.send_task("agentruns.dispatch", ("quick", {**trigger(), "id": ""}))
    resume.delay("not-a-token", True)
    # Refused at .delay() too; by the worker, sent by name (it logged a traceback at
    # ERROR, as if agentruns had failed).
    dispatch.app.send_task("agentruns.resume", ("not-a-token", "yes"))
    cancel.delay("no-such-run")
    execute.delay("no-such-run")
    expected = {
        "UnknownAgentError": 1,
        "InvalidTriggerError": 2,
        "InvalidTokenError": 1,
        "InvalidAnswerError": 1,
        "RunNotFoundError": 2,
    }

    def answered() -> dict[str, int] | None:
        counts = {name: worker.output().count(f"raised expected: {name}") for name in expected}
        done = engine.list_runs(status=RunStatus.COMPLETED)
        return counts if counts == expected and done else None

    wait_for(answered, "the worker to answer every message")
    time.sleep(0.5)  # a retry, or a second run, would show up by now
    (run,) = engine.list_runs()
    assert run.status is RunStatus.COMPLETED
    assert run.idempotency_key == "task:the-same-message"
    assert answered() == expected
    assert "Retry in" not in worker.output() and "Traceback" not in worker.output()
    assert worker.popen.poll() is None
    # A dispatch of an agent the worker lacks stores nothing: said at WARNING, with
    # the agents it has (Celery's line is INFO, and nothing else tells of it).
    said = (
        "WARNING/MainProcess] agentruns dispatch .+: unknown agent 'no-such-agent' "
        r"\(this worker has 'quick', .+: AGENTRUNS_AGENTS\); nothing was stored"
    )
    assert re.search(said, worker.output()), worker.output()


def test_a_retry_task_takes_a_failed_run_on_in_a_worker(cluster: Cluster, engine: Engine) -> None:
    from agentruns.tasks import retry

    (worker,) = cluster.workers("w1")
    run = engine.dispatch("quick", trigger({}), schedule=False)
    claimed = engine.store.claim(run.id, "gone:1", utcnow() + timedelta(seconds=30))
    assert claimed is not None
    error = RunError(code="model_error", message="overloaded")
    failing = Commit(status=RunStatus.FAILED, error=error, release_claim=True)
    engine.store.commit(claimed.run, Guard(status=RunStatus.RUNNING, epoch=claimed.epoch), failing)
    retry.delay(run.id, budget={"max_steps": 7})
    wait_for(lambda: engine.get_run(run.id).status is not RunStatus.FAILED, "the retry")
    done = wait_for(partial(completed, engine, run.id), "the run to complete")
    assert done.budget is not None and done.budget.max_steps == 7
    assert_replayed_once(engine, done, QUICK_SCRIPT)
    retry.delay(run.id)  # completed now: refused once, not retried
    wait_for(lambda: "raised expected: NotRetryableError" in worker.output(), "the refusal")
    assert "Retry in" not in worker.output()


def test_a_retry_message_delivered_again_does_not_retry_a_run_failed_since(
    cluster: Cluster, engine: Engine
) -> None:
    # A retry message delivered again (its worker died before it acked, and Redis gave
    # it back after the visibility timeout; or it retried an outage after a first try
    # that went through) queued again a run that had failed once more since, nobody
    # asking. Here the same message (its id) is sent again once the run failed again.
    from agentruns.tasks import retry

    (worker,) = cluster.workers("w1")
    run = engine.dispatch("decliner", trigger({}))

    def failed(calls: int) -> Run | None:
        now = engine.get_run(run.id)
        declined = len(cluster.tool_calls("decline", run.id))
        return now if now.status is RunStatus.FAILED and declined == calls else None

    wait_for(partial(failed, 1), "the run to fail")
    message = f"retry-{uuid.uuid4()}"
    retry.apply_async((run.id,), task_id=message)
    wait_for(partial(failed, 2), "the retried run to fail again")
    retry.apply_async((run.id,), task_id=message)
    said = f"run {run.id}: retry {message} was answered already (the run is failed now): not again"
    wait_for(lambda: said in worker.output(), "the message delivered again to be taken")
    time.sleep(0.5)  # a retry of the run would show by now
    assert failed(2) is not None
    # Another request (another message) retries it.
    retry.apply_async((run.id,), task_id=f"retry-{uuid.uuid4()}")
    wait_for(partial(failed, 3), "the run retried by another request to fail again")


def test_a_hanging_notifier_holds_back_no_other_run_in_a_worker(
    cluster: Cluster, engine: Engine
) -> None:
    # The notifier ran on the pool thread of the execute task whose run paused, and
    # tick called the notifiers one after another, its tasks piling up every second
    # while a chat webhook hung: paused runs held the pool's threads, and no other
    # run started until the webhook answered.
    cluster.workers("w1", concurrency=2, beat=True)
    asked = [engine.dispatch("asker", trigger({"n": n})) for n in range(3)]
    wait_for(lambda: len(cluster.tool_calls("notifying")) == 3 or None, "every notifier call")
    quick = engine.dispatch("quick", trigger({}))
    wait_for(partial(completed, engine, quick.id), "a run while the notifiers hang")
    assert cluster.tool_calls("notified") == []  # they hang still
    Path(f"{cluster.tool_log}.release").touch()
    for run in asked:
        wait_for(lambda r=run: engine.get_run(r.id).waiting.notified_at, "the notifications")  # type: ignore[union-attr]
    time.sleep(1.5)  # ticks every second: none calls a notifier again
    assert len(cluster.tool_calls("notifying")) == len(cluster.tool_calls("notified")) == 3


def test_a_notifier_a_stopping_worker_waits_for_answers_through_its_engine(
    cluster: Cluster, engine: Engine
) -> None:
    # The worker let go of its engine, then closed it, waiting for the notifier: the
    # notifier's get_engine() built a second engine, never drained nor closed.
    (worker,) = cluster.workers("w1")
    run = engine.dispatch("self_approver", trigger({}))
    wait_for(lambda: cluster.tool_calls("notifying", run.id) or None, "the notifier")
    worker.popen.send_signal(signal.SIGTERM)
    time.sleep(2)  # into its shutdown, waiting for the notifier
    Path(f"{cluster.tool_log}.release").touch()
    assert worker.popen.wait(timeout=20) == 0
    assert worker.output().count("agentruns engine") == 1, worker.output()[-3000:]
    answered = engine.get_run(run.id)
    assert answered.status is RunStatus.QUEUED and answered.waiting is None


def test_a_tool_imports_from_the_working_directory_as_it_runs_in_a_worker(
    cluster: Cluster, engine: Engine, tmp_path: Path
) -> None:
    # A worker put its working directory on the path only while it imported the
    # agent modules: a tool that imported a project's module when called (as the
    # CLI's executions could) failed with ModuleNotFoundError in a worker.
    project = tmp_path / "project"
    project.mkdir()
    (project / "lazyhelper.py").write_text('ANSWER = "from the working directory"\n')
    (project / "lazyagents.py").write_text(
        "from agentruns import Agent, tool\n"
        "from agentruns.models import ScriptedModel, text, tool_use\n\n"
        "@tool\n"
        "def lazy() -> str:\n"
        '    """Answer from a module imported when called."""\n'
        "    import lazyhelper\n\n"
        "    return lazyhelper.ANSWER\n\n"
        'agent = Agent("lazy", ScriptedModel([tool_use("lazy", {}), text("done")]), tools=[lazy])\n'
    )
    env = {**cluster.env, "AGENTRUNS_AGENTS": "lazyagents"}
    group = BaseCluster(env, cluster.queue, tmp_path, cwd=project)
    try:
        from agentruns.tasks import dispatch

        group.workers("w1")
        dispatch.delay("lazy", trigger({}), idempotency_key="lazy")
        (run,) = wait_for(lambda: [r for r in engine.list_runs() if r.idempotency_key == "lazy"])
        wait_for(partial(completed, engine, run.id), "the run to complete")
        tool_step = engine.steps(run.id)[1]
        assert tool_step.error is None and tool_step.output == "from the working directory"
    finally:
        group.stop(graceful=False)


def test_messages_sent_while_postgres_is_away_wait_for_it_and_are_answered(
    cluster: Cluster, engine: Engine, db_url: str
) -> None:
    from agentruns.tasks import cancel, dispatch

    queued = engine.dispatch("quick", trigger({"n": 1}), schedule=False)
    proxy = Proxy(("127.0.0.1", 5432))
    try:
        # The worker reaches Postgres only through the proxy, cut before it starts:
        # its engine cannot be built, then its tasks cannot write.
        port = sa.make_url(db_url).port or 5432
        cluster.env["AGENTRUNS_DATABASE_URL"] = db_url.replace(f":{port}/", f":{proxy.port}/")
        proxy.cut()
        (worker,) = cluster.workers("w1")
        dispatch.delay("quick", trigger({"n": 2}), idempotency_key="sent-while-away")
        cancel.delay(queued.id)
        wait_for(lambda: worker.output().count("Retry in") >= 4, "the tasks to retry, twice")
        assert engine.list_runs() == [queued]
        proxy.restore()
        wait_for(lambda: engine.get_run(queued.id).status is RunStatus.CANCELLED)
        sent = wait_for(lambda: [r for r in engine.list_runs() if r.idempotency_key])
        wait_for(partial(completed, engine, sent[0].id))
    finally:
        proxy.close()


@pytest.mark.parametrize("since_start", [False, True])
def test_a_sweep_while_postgres_is_away_fails_in_one_line_and_the_next_works(
    cluster: Cluster, db_url: str, since_start: bool
) -> None:
    # Every tick and recover while the database was away logged a traceback of about
    # a hundred lines: beat's sweeps flooded a worker's log for as long as it lasted.
    # A worker that started meanwhile (its engine not built yet) gave each sweep back
    # to the queue, with its traceback, again and again.
    proxy = Proxy(("127.0.0.1", 5432))
    try:
        port = sa.make_url(db_url).port or 5432
        cluster.env["AGENTRUNS_DATABASE_URL"] = db_url.replace(f":{port}/", f":{proxy.port}/")
        swept = re.compile(r"Task agentruns\.recover\[\S+\] succeeded")
        if since_start:
            proxy.cut()
            (worker,) = cluster.workers("w1", beat=True)  # sweeps every second
        else:
            (worker,) = cluster.workers("w1", beat=True)
            wait_for(lambda: swept.search(worker.output()), "a sweep")
            proxy.cut()
        for sweep in ("tick", "recover"):
            line = f"WARNING/MainProcess] agentruns {sweep} could not sweep: OperationalError: "
            wait_for(lambda line=line: worker.output().count(line) >= 2, f"{sweep} to fail")
        # So does an execution's nudge (its run is stored: recover sends another).
        from agentruns.tasks import execute

        nudged = str(uuid.uuid4())
        execute.delay(nudged)
        said = f"agentruns execute of run {nudged} could not run (recover runs it): Operat"
        wait_for(lambda: said in worker.output(), "the execute to fail")
        assert "Traceback" not in worker.output()
        assert "raised unexpected" not in worker.output()
        assert "reject requeue" not in worker.output()
        before = len(swept.findall(worker.output()))
        proxy.restore()
        wait_for(lambda: len(swept.findall(worker.output())) > before, "a sweep after it")
    finally:
        proxy.close()


def test_messages_sent_before_the_database_is_migrated_are_answered_after(
    cluster: Cluster, empty_pg: str
) -> None:
    from agentruns.tasks import dispatch

    url = empty_pg  # the workers are deployed before `agentruns migrate`
    try:
        cluster.env["AGENTRUNS_DATABASE_URL"] = url
        (worker,) = cluster.workers("w1")  # deployed before `agentruns migrate`
        dispatch.delay("quick", trigger({"n": 1}), idempotency_key="before-migrate")
        said = "cannot work on this database yet"
        wait_for(lambda: said in worker.output(), "the dispatch to be given back")
        # Said as it started, without a restart asked for: migrating is enough.
        assert "(until then, this worker gives every message back)" in worker.output()
        assert "restart" not in worker.output()
        migrate(url)
        store = SqlStore(url)
        try:
            wait_for(lambda: [r for r in store.list_runs() if r.status is RunStatus.COMPLETED])
        finally:
            store.close()
    finally:
        cluster.stop(graceful=False)


def test_a_worker_that_cannot_work_on_the_database_leaves_the_nudges_to_others(
    cluster: Cluster, engine: Engine, empty_pg: str
) -> None:
    # A worker whose engine cannot be built (deployed before `agentruns migrate`,
    # here on a database of its own never migrated) acked the executions it took:
    # runs another worker could have run stayed queued until recover().
    good = cluster.env["AGENTRUNS_DATABASE_URL"]
    try:
        cluster.env["AGENTRUNS_DATABASE_URL"] = empty_pg
        (early,) = cluster.workers("early")
        cluster.env["AGENTRUNS_DATABASE_URL"] = good
        cluster.workers("ready")
        runs = [engine.dispatch("quick", trigger({"n": i})) for i in range(6)]
        for run in runs:
            wait_for(partial(completed, engine, run.id), "every run to complete", 30)
        said = early.output()
        assert "cannot work on this database yet" in said
        # Each message given back logged the refused schema's whole chain (about 40
        # lines, every second, for each): now Celery's rejection only.
        assert "The above exception was the direct cause" not in said
    finally:
        cluster.stop(graceful=False)


def test_a_worker_that_cannot_build_its_engine_gives_every_message_back(
    cluster: Cluster, engine: Engine
) -> None:
    from agentruns.tasks import cancel, dispatch

    # A worker deployed with an agent module that does not import acked and dropped
    # every dispatch (and cancel, resume, retry) it took: beside a good worker, most
    # of the runs sent were never stored. One whose module raised an OSError (a
    # config file not there) took it for an outage, and acked the nudges and sweeps.
    waiting = engine.dispatch("quick", trigger({"n": 0}), schedule=False)
    good = cluster.env["AGENTRUNS_AGENTS"]
    try:
        cluster.env["AGENTRUNS_AGENTS"] = f"{good},tests.support.broken_agents"
        (broken,) = cluster.workers("broken")
        began = time.monotonic()
        for i in range(10):
            dispatch.delay("quick", trigger({"n": i}), idempotency_key=f"sent-{i}")
        cancel.delay(waiting.id)
        said = "this worker cannot build its engine (AgentrunsError: cannot import the agent"
        wait_for(lambda: said in broken.output(), "the broken worker to give messages back")
        assert "(AGENTRUNS_AGENTS): FileNotFoundError: " in broken.output()
        cluster.env["AGENTRUNS_AGENTS"] = good
        cluster.workers("good")
        wait_for(
            lambda: len([r for r in engine.list_runs() if r.idempotency_key]) == 10,
            "every dispatch to be stored",
            60,
        )
        sent = [r for r in engine.list_runs() if r.idempotency_key]
        for run in sent:
            wait_for(partial(completed, engine, run.id), "every run to complete", 30)
        wait_for(lambda: engine.get_run(waiting.id).status is RunStatus.CANCELLED, "the cancel")
        output = broken.output()
        # Why, in full, once; then one line per message given back.
        assert output.count("cannot build its engine; it gives every message back") == 1
        lines = output.splitlines()
        given_back = [
            i for i, line in enumerate(lines) if "reject requeue=True: this worker cannot" in line
        ]
        assert len(given_back) >= 2
        # No traceback after each (Celery logs one with every rejection).
        assert all(i + 1 == len(lines) or lines[i + 1].startswith("[") for i in given_back)
        # The module's code ran again only every so often, not for each message.
        tries = len(cluster.tool_calls("import", "broken_agents"))
        assert 1 <= tries <= 2 + (time.monotonic() - began) / worker_module._BUILD_AGAIN_AFTER_S
    finally:
        cluster.stop(graceful=False)


def test_a_task_called_in_a_process_that_cannot_build_its_engine_raises_why() -> None:
    # Called as a function, outside a worker, it slept a second and raised Celery's
    # Reject ("this worker cannot build its engine"), not what was wrong.
    code = (
        "from agentruns.tasks import cancel\n"
        "try:\n"
        "    cancel('0b7f3f1e-7a4c-4b7e-9d39-0a4c6f0e2d11')\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "AGENTRUNS_SECRET"}
    env.update(AGENTRUNS_REDIS_URL=REDIS_URL, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert done.stdout.startswith("AgentrunsError AGENTRUNS_SECRET is not set"), done
    assert "cannot build its engine" not in done.stderr


def test_prefork_children_have_their_own_engines_and_drain_on_sigterm(
    cluster: Cluster, engine: Engine, leases: RedisLeases
) -> None:
    from agentruns.tasks import dispatch

    (worker,) = cluster.workers("w1", pool="prefork", concurrency=2)
    quick = [engine.dispatch("quick", trigger({"n": i})) for i in range(4)]
    for run in quick:
        wait_for(partial(completed, engine, run.id), "the quick runs to complete")
    # Each child built its own engine (and database pool) after the fork.
    children = set(cluster.tool_calls("note"))
    assert children and worker.pid not in children

    dispatch.delay("charger", trigger({"card": "4242"}), idempotency_key="drain-child")
    run = wait_for(
        lambda: next((r for r in engine.list_runs() if r.agent == "charger"), None),
        "the run to be stored",
    )
    wait_for(lambda: engine.steps(run.id), "the first step to be saved")
    owner = wait_for(lambda: leases.holder(run.id), "a lease on the run")
    assert int(owner.split(":")[-2]) != worker.pid  # a child holds it, not the main process

    stopped = time.monotonic()
    worker.popen.send_signal(signal.SIGTERM)  # the main process tells its children to drain
    assert worker.popen.wait(timeout=10) == 0
    assert time.monotonic() - stopped < 5.0
    interrupted = engine.get_run(run.id)
    assert interrupted.status is RunStatus.INTERRUPTED
    assert interrupted.claim is None


def test_a_cold_shutdown_of_a_prefork_worker_is_a_crash_that_recover_resumes(
    cluster: Cluster, engine: Engine, leases: RedisLeases
) -> None:
    # Celery kills the children running tasks, then stops the pool: the drain that
    # followed read the stopped pool and raised (AttributeError in the log).
    (worker,) = cluster.workers("w1", pool="prefork", concurrency=2)
    run = engine.dispatch("charger", trigger({"card": "4242"}))
    wait_for(lambda: engine.steps(run.id), "the first step to be saved")
    stopped = time.monotonic()
    worker.popen.send_signal(signal.SIGQUIT)
    worker.popen.wait(timeout=20)
    assert "raised: AttributeError" not in worker.output(), worker.output()[-3000:]
    # Not held up by drains its killed children could not finish (it took 12 s).
    assert time.monotonic() - stopped < 6

    cluster.workers("w2")

    def resumed() -> Run | None:
        engine.recover()  # once the killed child's lease has expired
        return completed(engine, run.id)

    done = wait_for(resumed, "recover to resume it")
    assert_replayed_once(engine, done, CHARGE_SCRIPT)


def test_a_workers_soft_time_limit_does_not_cut_into_a_run(
    cluster: Cluster, engine: Engine
) -> None:
    """A soft limit raises inside the task wherever it is: in an effect tool after
    its side effect, the call was recorded as failed (and the model told so). The
    worker's limit is ignored for agentruns' tasks, and it says so at start."""
    (worker,) = cluster.workers(
        "w1", pool="prefork", concurrency=1, options=["--soft-time-limit=1"]
    )
    run = engine.dispatch("charger", trigger({"card": "4242"}))  # five 0.4 s model calls
    done = wait_for(lambda: completed(engine, run.id), "the run to complete", 30)
    assert done.output == "Charged."
    assert [s.error for s in engine.steps(run.id) if s.error] == []
    assert len(cluster.tool_calls("charge", run.id)) == 1
    assert "ignore the worker's soft time limit" in worker.output()


def test_a_workers_time_limit_interrupts_a_run_that_recover_resumes(
    tmp_path: Path, cluster: Cluster, engine: Engine, celery_app: Any
) -> None:
    """The hard limit was also the soft one, and the prefork pool raises the soft
    one first, wherever the task is: the model call it stopped failed the run
    (model_error), a tool it stopped was the tool's error. A soft limit of
    ``task_annotations`` reached the tasks too. Now the soft limit comes a little
    before the hard one and the execution settles its run interrupted; the
    annotation's limit is ignored. The limits are the worker's: a message carried
    the producer's (with this process's settings, soft 2990 s), which won."""
    import agentruns.tasks  # noqa: F401

    assert celery_app.tasks["agentruns.execute"]  # finalized: sends read the task's options

    conf = tmp_path / "deployment"
    conf.mkdir()
    (conf / "celeryconfig.py").write_text(
        "from agentruns.celery import defaults\n"
        "globals().update(defaults())\n"
        "task_time_limit = 4\n"  # the run settles a second before it
        "task_annotations = {'*': {'soft_time_limit': 0.5}}\n"
    )
    env = {**cluster.env, "AGENTRUNS_TEST_LATENCY": "1.0"}
    group = BaseCluster(env, cluster.queue, tmp_path, cwd=conf)
    try:
        (worker,) = group.workers("w1", pool="prefork", concurrency=1)
        run = engine.dispatch("charger", trigger({"card": "4242"}))  # five 1 s model calls
        stopped = wait_for(
            lambda: engine.get_run(run.id).status is RunStatus.INTERRUPTED or None,
            "the time limit to interrupt the run",
            20,
        )
        assert stopped
        assert engine.get_run(run.id).claim is None
        # (No "Hard time limit exceeded": the task returned first.)
        assert "stopped its execution; recover() resumes it" in worker.output()
        assert "Hard time limit" not in worker.output(), worker.output()[-3000:]

        def resumed() -> Run | None:
            # A resumed execution has the same limit: if the first saved only two of
            # the five steps (the third call ended just past its limit), the next is
            # interrupted too, from a later checkpoint, and resumed again.
            engine.recover()
            again = engine.get_run(run.id)
            assert again.status in (*RESUMABLE, RunStatus.COMPLETED), again
            return again if again.status is RunStatus.COMPLETED else None

        done = wait_for(resumed, "recover to resume it", 40)
        assert_replayed_once(engine, done, CHARGE_SCRIPT)
        assert [s.error for s in engine.steps(run.id) if s.error] == []
        assert len(cluster.tool_calls("charge", run.id)) == 1
    finally:
        group.stop(graceful=False)
        for proc in group.procs:  # shown by pytest when the test failed
            print(f"----- {proc.name} (pid {proc.pid}) -----\n{proc.output()[-6000:]}")


@pytest.mark.parametrize(
    ("broker", "limit"),
    [
        ("redis://127.0.0.1:6379/0", 3000),
        ("amqp://guest@127.0.0.1//", 1200),
        ("pyamqp://h//", 1200),
    ],
)
def test_the_time_limit_sits_below_how_long_the_broker_lets_a_message_go_unacked(
    monkeypatch: pytest.MonkeyPatch, broker: str, limit: int
) -> None:
    # RabbitMQ closes the channel of a delivery unacked for 30 minutes (its default
    # consumer_timeout), and the worker ends: the limit was Redis' (50 minutes).
    from agentruns.celery import defaults

    monkeypatch.setenv("AGENTRUNS_BROKER_URL", broker)
    get_settings.cache_clear()
    try:
        assert defaults()["task_time_limit"] == limit
    finally:
        get_settings.cache_clear()


def test_celeryconfig_starts_from_the_at_least_once_defaults() -> None:
    """celeryconfig.py (a deployment's override point) carries agentruns' own settings."""
    from agentruns.celery import defaults

    settings = runpy.run_path(str(ROOT / "celeryconfig.py"))  # read now, like the defaults
    for key, value in defaults().items():
        assert settings[key] == value, key
    assert settings["task_acks_late"] and settings["task_reject_on_worker_lost"]
    assert settings["worker_prefetch_multiplier"] == 1
    visibility = settings["broker_transport_options"]["visibility_timeout"]
    assert settings["task_time_limit"] < visibility
    assert settings["worker_send_task_events"] and settings["task_send_sent_event"]
    schedule = settings["beat_schedule"]
    assert {entry["task"] for entry in schedule.values()} == {"agentruns.tick", "agentruns.recover"}
    assert all(
        entry["options"]["expires"] == entry["schedule"] + CLOCK_SKEW_S
        for entry in schedule.values()
    )


def test_a_worker_that_does_not_consume_the_sweeps_queue_says_so(
    cluster: Cluster, queue: str
) -> None:
    # `-Q` with the runs' queue alone: beat's tick and recover never reach it.
    (narrow,) = cluster.workers("narrow", options=["-Q", queue])
    (full,) = cluster.workers("full")
    assert f"does not consume '{sweeps_queue(queue)}'" in narrow.output()
    assert "does not consume" not in full.output()


def _deployment(tmp_path: Path, *lines: str) -> Path:
    """A directory holding a team's own celeryconfig.py of these lines."""
    conf = tmp_path / "deployment"
    conf.mkdir(exist_ok=True)
    (conf / "celeryconfig.py").write_text("\n".join(lines) + "\n")
    return conf


def _stop_and_show(group: BaseCluster) -> None:
    group.stop(graceful=False)
    for proc in group.procs:  # shown by pytest when the test failed
        print(f"----- {proc.name} (pid {proc.pid}) -----\n{proc.output()[-6000:]}")


def test_sweeps_go_where_a_teams_routes_send_agentruns_tasks(
    tmp_path: Path, cluster: Cluster, queue: str
) -> None:
    # A team routes agentruns' tasks to a queue of their own with a glob, and starts
    # its workers with -Q naming it: the sweeps went to the sweeps queue of the
    # default one instead, which no worker read.
    agents = f"{queue}.agents"
    conf = _deployment(tmp_path, f"task_routes = {{'agentruns.*': {{'queue': {agents!r}}}}}")
    group = BaseCluster(cluster.env, queue, tmp_path, cwd=conf)
    try:
        (worker,) = group.workers("agents", options=["-Q", agents])
        group.beat()
        for task in ("tick", "recover"):
            ran = rf"agentruns\.{task}\[\S+\] succeeded"
            wait_for(lambda t=ran: re.search(t, worker.output()), f"a {task} on the worker")
        assert "does not consume" not in worker.output()
    finally:
        _stop_and_show(group)


def test_a_worker_that_does_not_consume_where_the_sweeps_are_routed_says_so(
    tmp_path: Path, cluster: Cluster, queue: str
) -> None:
    # It consumes the runs' queue and the sweeps queue beside it, but the team's
    # routes send the sweeps elsewhere: it said nothing.
    ops = f"{queue}.ops"
    routes = {"agentruns.tick": {"queue": ops}, "agentruns.recover": {"queue": ops}}
    conf = _deployment(tmp_path, f"task_routes = {routes!r}")
    group = BaseCluster(cluster.env, queue, tmp_path, cwd=conf)
    try:
        (worker,) = group.workers("runs", options=["-Q", f"{queue},{sweeps_queue(queue)}"])
        assert f"does not consume '{ops}'" in worker.output()
    finally:
        _stop_and_show(group)


def test_a_sweep_from_a_beat_whose_clock_is_behind_is_still_run(
    cluster: Cluster, queue: str
) -> None:
    # Celery stamps `expires` with the sender's clock and checks it with the
    # worker's: when it was the interval alone, a beat 30 s behind the workers
    # had every tick and recover dropped as expired.
    from datetime import UTC, datetime, timedelta

    from agentruns.tasks import tick

    (worker,) = cluster.workers("w1")
    expires = defaults()["beat_schedule"]["agentruns.tick"]["options"]["expires"]
    beats_now = datetime.now(UTC) - timedelta(seconds=30)
    # To the sweeps queue, as beat sends it (this process's routes may predate the
    # session's queue).
    sent = tick.apply_async(
        expires=beats_now + timedelta(seconds=expires), queue=sweeps_queue(queue)
    )
    task = rf"agentruns\.tick\[{sent.id}\]"
    ran_or_dropped = rf"{task} succeeded|Discarding revoked task: {task}"
    done = wait_for(lambda: re.search(ran_or_dropped, worker.output()), "the worker to take it")
    assert "succeeded" in done.group(0)


def test_producer_messages_retry_an_outage_for_as_long_as_it_lasts() -> None:
    # A dispatch, resume or cancel message is the only record of its request: no
    # number of retries (at most a minute apart) may end in acking it unanswered.
    from agentruns.tasks import cancel, dispatch, resume

    assert dispatch.max_retries is None and resume.max_retries is None
    assert cancel.max_retries is None


TEAM_APP = """
from celery import Celery

app = Celery("teamapp", broker={broker!r}, include=["agentruns.tasks"])
app.conf.update(task_default_queue={queue!r}, task_serializer="json", result_backend=None)
"""


def test_a_teams_own_app_sends_its_workers_executions_to_its_own_queue(
    cluster: Cluster, engine: Engine, tmp_path: Path
) -> None:
    # Its worker's engine sent the execution after an approval (and every other one)
    # through agentruns' own app, to AGENTRUNS_QUEUE, which no worker of the team's
    # consumed: the run stayed queued, unsaid.
    from celery import Celery

    from agentruns.tasks import dispatch, resume

    theirs = f"{cluster.queue}.team"
    app_dir = tmp_path / "team"
    app_dir.mkdir()
    (app_dir / "teamapp.py").write_text(TEAM_APP.format(broker=REDIS_URL, queue=theirs))
    env = {**cluster.env, "PYTHONPATH": f"{app_dir}{os.pathsep}{ROOT}"}
    team_cluster = BaseCluster(env, theirs, tmp_path, cwd=app_dir, app="teamapp")
    team = Celery("team", broker=REDIS_URL, set_as_current=False)
    team.conf.task_default_queue = theirs
    try:
        team_cluster.workers("team-w1")
        sent = team.tasks[dispatch.name].delay("asker", trigger({}), idempotency_key="team")
        assert sent.id
        waiting = wait_for(
            lambda: next(
                (r for r in engine.list_runs(status=RunStatus.WAITING) if r.agent == "asker"),
                None,
            ),
            "the run to wait for its approval",
        )
        team.tasks[resume.name].delay(engine.approval_token(waiting.id), True)
        wait_for(
            lambda: engine.get_run(waiting.id).status is RunStatus.COMPLETED or None,
            "the approved run to complete",
        )
    finally:
        team_cluster.stop(graceful=False)
        forget_queue(theirs, REDIS_URL)


def test_a_teams_own_app_runs_agentruns_tasks_with_their_delivery_options() -> None:
    # Its settings are Celery's defaults (acks early, results kept): a message its
    # worker lost mid-task was a lost run. (The tasks are shared: every app gets them.)
    import agentruns.tasks  # noqa: F401

    team = Celery("team", set_as_current=False)
    names = ["dispatch", "execute", "resume", "cancel", "tick", "recover"]
    for task in (team.tasks[f"agentruns.{name}"] for name in names):
        assert task.app is team
        assert (task.acks_late, task.reject_on_worker_lost, task.ignore_result) == (True,) * 3


def _sent_messages(queue: str) -> list[dict[str, Any]]:
    """The messages waiting in ``queue``, oldest first."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        return [json.loads(m) for m in reversed(client.lrange(queue, 0, -1))]
    finally:
        client.close()


def test_a_dispatch_whose_trigger_a_worker_would_refuse_is_refused_where_it_is_sent(
    celery_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The message's JSON carried a NaN: the worker refused it, in its log, and the
    # sender never knew.
    from agentruns import tasks

    sent: list[Any] = []
    monkeypatch.setattr(tasks, "send_together", lambda *args: sent.append(args))
    for bad, said in (
        (trigger({"ratio": float("nan")}), "payload is not JSON"),
        ({"payload": 1}, "source"),
        ("issue 7", "a trigger is a TriggerEnvelope or a dict"),
    ):
        with pytest.raises(InvalidTriggerError, match=said):
            tasks.dispatch.delay("quick", bad)
        with pytest.raises(InvalidTriggerError, match=said):
            tasks.dispatch.apply_async(kwargs={"agent": "quick", "trigger": bad})
    assert sent == []
    tasks.dispatch.delay("quick", trigger({"ratio": 0.5}))
    assert len(sent) == 1


def test_what_a_worker_would_refuse_of_any_tasks_arguments_is_refused_where_it_is_sent(
    celery_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each was sent, and refused in the worker's log (an INFO line): the request was
    # lost and the sender never knew. An empty trigger id was worse: the worker took
    # the message's id for the key, and each send stored a run.
    from agentruns import tasks

    sent: list[Any] = []
    monkeypatch.setattr(tasks, "send_together", lambda *args: sent.append(args))
    base = trigger({})
    for bad, said in (
        ({"trigger": {**base, "id": ""}}, "the trigger's id .* must not be empty"),
        ({"trigger": {**base, "id": "x" * 501}}, "501 characters long"),
        ({"trigger": {**base, "id": "a\x00b"}}, "NUL"),
        ({"trigger": {**base, "thread": ""}}, "thread must not be empty"),
        ({"trigger": {**base, "source": ""}}, "source must not be empty"),
        ({"trigger": base, "thread": "t" * 494}, "thread is 494 characters"),
        ({"trigger": base, "idempotency_key": ""}, "idempotency_key must not be empty"),
        ({"trigger": base, "idempotency_key": 5}, "idempotency_key must be UTF-8 text"),
        ({"trigger": base, "concurrency_key": ""}, "concurrency_key must not be empty"),
        ({"trigger": base, "budget": {"max_steps": 0}}, "invalid budget: max_steps"),
    ):
        with pytest.raises(InvalidTriggerError, match=said):
            tasks.dispatch.apply_async(kwargs={"agent": "quick", **bad})
    with pytest.raises(InvalidTriggerError, match="invalid budget: max_steps"):
        tasks.retry.delay("some-run", budget={"max_steps": -1})
    for approved, reason in (("yes", None), (True, 5)):
        with pytest.raises(InvalidAnswerError):
            tasks.resume.delay("token", approved, reason)
    assert sent == []
    tasks.dispatch.delay("quick", base, idempotency_key="k", thread="t", budget={"max_steps": 3})
    tasks.retry.delay("some-run", budget={"max_steps": 30})
    tasks.resume.delay("token", approved=False, reason="no")
    assert len(sent) == 3


def test_a_teams_own_app_on_message_protocol_1_refuses_to_send_agentruns_tasks(
    queue: str,
) -> None:
    """Protocol 1 has no ``argsrepr``: its task events would show a trigger's payload
    and a resume token. Made with agentruns' AMQP, the app sends them with protocol 2."""
    from agentruns.tasks import dispatch

    team = Celery("team", broker=REDIS_URL, set_as_current=False)
    team.conf.update(task_protocol=1, task_default_queue=f"{queue}.team")
    with pytest.raises(ImproperlyConfigured, match="task_protocol = 2"):
        team.tasks[dispatch.name].delay("quick", trigger({"card": "4111-SECRET"}))
    # But a worker of that app retrying the message it holds (an outage) sends it
    # again: refused, the message was dropped, and with it the only record of a run.
    team.conf.task_default_queue = f"{queue}.team-retry"
    held = team.tasks[dispatch.name]
    held.push_request(id="held-message", retries=0, called_directly=False)
    try:
        held.apply_async(("quick", trigger({"card": "4111"})))
        assert len(_sent_messages(f"{queue}.team-retry")) == 1
    finally:
        held.pop_request()
        forget_queue(f"{queue}.team-retry", REDIS_URL)
    team.conf.task_default_queue = f"{queue}.team"
    team = Celery("team", broker=REDIS_URL, amqp="agentruns.celery:AMQP", set_as_current=False)
    team.conf.update(task_protocol=1, task_default_queue=f"{queue}.team")
    try:
        team.tasks[dispatch.name].delay("quick", trigger({"card": "4111-SECRET"}))
        (message,) = _sent_messages(f"{queue}.team")
        assert message["headers"]["task"] == "agentruns.dispatch"  # protocol 2's header
        assert "<payload>" in message["headers"]["argsrepr"]
    finally:
        forget_queue(f"{queue}.team", REDIS_URL)


class TaskEvents:
    """The task events published on this Redis while the block runs, as they went out:
    one list per PUBLISH (what Flower's receiver decodes, read off the wire)."""

    def __init__(self) -> None:
        self.client = redis.Redis.from_url(REDIS_URL)
        self.stop = threading.Event()
        self.publishes: list[list[dict[str, Any]]] = []
        self._thread = threading.Thread(target=self._listen)

    def __enter__(self) -> TaskEvents:
        before = self.client.pubsub_numpat()
        self._thread.start()
        wait_for(lambda: self.client.pubsub_numpat() > before or None, "the event subscription")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join(5)

    def _listen(self) -> None:
        import base64
        import json

        pubsub = self.client.pubsub()
        pubsub.psubscribe("*celeryev*")
        while not self.stop.is_set():
            message = pubsub.get_message(timeout=0.1)
            if message is None or message["type"] != "pmessage":
                continue
            body = json.loads(base64.b64decode(json.loads(message["data"])["body"]))
            events = body if isinstance(body, list) else [body]
            tasks = [e for e in events if e.get("type", "").startswith("task-")]
            if tasks:
                self.publishes.append(tasks)
        pubsub.close()

    def of(self, *task_ids: str) -> list[dict[str, Any]]:
        return [e for publish in list(self.publishes) for e in publish if e["uuid"] in task_ids]

    def worker_publishes(self) -> list[list[dict[str, Any]]]:
        """The workers' publishes (a producer's ``task-sent`` goes out alone)."""
        return [p for p in list(self.publishes) if all(e["type"] != "task-sent" for e in p)]


def test_task_events_show_no_trigger_payload_and_no_resume_token(
    cluster: Cluster, engine: Engine
) -> None:
    """What Flower shows of a task (its ``task-sent`` and ``task-received`` events)
    holds neither a trigger's payload nor a resume token; the worker still gets both."""
    from agentruns.tasks import dispatch, resume

    cluster.workers("w1")
    with TaskEvents() as events:
        sent = dispatch.delay("quick", trigger({"card": "4111-SECRET"}), idempotency_key="shown")
        answered = resume.delay("TOKEN-SECRET.sig", True)
        kinds = ("task-sent", "task-received")
        wanted = {(kind, i) for kind in kinds for i in (sent.id, answered.id)}

        def seen() -> list[dict[str, Any]] | None:
            shown = [e for e in events.of(sent.id, answered.id) if e["type"] in kinds]
            return shown if wanted <= {(e["type"], e["uuid"]) for e in shown} else None

        shown = wait_for(seen, "the tasks' sent and received events")
    for event in shown:
        text = f"{event['args']} {event['kwargs']}"
        assert "SECRET" not in text, event
        assert ("<payload>" if event["uuid"] == sent.id else "<resume token>") in text, event
    # The worker had the payload: the run it stored holds it.
    run = wait_for(
        lambda: next((r for r in engine.list_runs() if r.idempotency_key == "shown"), None),
        "the dispatched run",
    )
    assert run.trigger.payload == {"card": "4111-SECRET"}


SEND_ON_PROTOCOL_1 = """
import json
from agentruns.celery import app
from agentruns.tasks import dispatch, resume
assert app.conf.task_protocol == 1
trigger = {"source": "manual", "trigger": "manual", "payload": {"card": "4111-SECRET"}}
sent = [dispatch.delay("quick", trigger).id, resume.delay("TOKEN-SECRET.sig", True).id]
sent.append(app.send_task("team.report", args=["TEAM-ARGS"]).id)
print(json.dumps(sent))
"""


def test_a_celeryconfig_on_message_protocol_1_still_hides_payloads_and_tokens(
    tmp_path: Path, queue: str
) -> None:
    # Protocol 1's messages have no argsrepr: their task-sent events showed
    # everything. agentruns' tasks go with protocol 2; the team's keep protocol 1.
    sent_to = f"{queue}.proto1"  # no worker reads it
    conf = _deployment(tmp_path, "task_protocol = 1")
    env = {
        **os.environ,
        "AGENTRUNS_DATABASE_URL": "sqlite:///x.db",
        "AGENTRUNS_BROKER_URL": REDIS_URL,
        "AGENTRUNS_QUEUE": sent_to,
        "PYTHONPATH": str(ROOT),
    }
    try:
        with TaskEvents() as events:
            out = subprocess.run(
                [sys.executable, "-c", SEND_ON_PROTOCOL_1],
                cwd=conf,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            ).stdout
            ids = json.loads(out.strip().splitlines()[-1])
            wait_for(lambda: len(events.of(*ids)) == 3 or None, "the task-sent events")
        for event in events.of(*ids[:2]):
            assert "SECRET" not in f"{event['args']} {event['kwargs']}", event
        dispatched, resumed, theirs = _sent_messages(sent_to)
        assert dispatched["headers"]["task"] == "agentruns.dispatch"  # protocol 2
        assert resumed["headers"]["argsrepr"] == "(<resume token>, True)"
        assert "task" not in theirs["headers"]  # protocol 1
    finally:
        forget_queue(sent_to, REDIS_URL)


def test_what_a_worker_lists_of_its_held_tasks_shows_no_payload_and_no_token(
    cluster: Cluster, celery_app: Any, queue: str
) -> None:
    """Flower's worker page and ``celery inspect scheduled`` list what a worker holds
    (a ``resume`` retrying an outage waits as one) with Celery's raw arguments,
    unless the task's request says otherwise; agentruns' requests show what the
    task events show."""
    from agentruns.tasks import dispatch, resume

    cluster.workers("w1")
    later = {"countdown": 60}
    held = {
        resume.apply_async(("TOKEN-SECRET.sig", True), **later).id,
        dispatch.apply_async(("quick", trigger({"card": "4111-SECRET"})), **later).id,
    }
    inspect = celery_app.control.inspect(destination=[f"w1-{queue}@{socket.gethostname()}"])

    def listed() -> list[dict[str, Any]] | None:
        entries = [e["request"] for per in (inspect.scheduled() or {}).values() for e in per]
        return entries if held <= {e["id"] for e in entries} else None

    for request in wait_for(listed, "the worker to hold both tasks"):
        text = f"{request['args']} {request['kwargs']}"
        assert "SECRET" not in text, request
        assert "<resume token>" in text or "<payload>" in text, request
    celery_app.control.revoke(list(held))


def test_what_a_task_shows_of_its_arguments_stays_within_celerys_bound() -> None:
    """Celery cuts its own ``argsrepr`` at 1,024 characters; the one agentruns gives
    instead is cut there too, and an argument whose ``repr`` fails still shows."""
    from agentruns.tasks import _arguments_shown, dispatch

    class Unshowable:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    shown_args, shown_kwargs = _arguments_shown(
        dispatch, ("a" * 5000, trigger({"card": "SECRET"})), {"thread": Unshowable()}
    )
    assert len(shown_args) == 1024 and shown_args.startswith("('aaa") and shown_args.endswith("...")
    assert "Unshowable" in shown_kwargs
    shown_args, _ = _arguments_shown(dispatch, ("quick", trigger({"card": "SECRET"})), {})
    assert "SECRET" not in shown_args and "<payload>" in shown_args


def test_a_busy_worker_publishes_its_task_events_in_batches(
    cluster: Cluster, engine: Engine
) -> None:
    from agentruns.tasks import dispatch

    cluster.workers("w1", concurrency=20)
    with TaskEvents() as events:
        ids = {
            dispatch.delay("quick", trigger({"n": i}), idempotency_key=f"batch-{i}").id
            for i in range(40)
        }
        wait_for(
            lambda: sum(r.status is RunStatus.COMPLETED for r in engine.list_runs()) == 40 or None,
            "40 completed runs",
        )

        # Each task's received, started and succeeded events arrive, and together.
        # (Only this test's: other workers on this Redis publish theirs on it too.)
        def publishes() -> list[list[dict[str, Any]]]:
            mine = ([e for e in p if e["uuid"] in ids] for p in events.worker_publishes())
            return [p for p in mine if p]

        def sent() -> int:
            return sum(len(p) for p in publishes())

        wait_for(lambda: sent() >= 120 or None, "the tasks' events")
    assert sent() == 120
    assert len(publishes()) <= 120 / 4, publishes()  # Celery's consumer: 50 here


def test_a_worker_stopping_publishes_the_task_events_it_still_held(
    cluster: Cluster, engine: Engine
) -> None:
    from agentruns.tasks import dispatch

    (worker,) = cluster.workers("w1")
    with TaskEvents() as events:
        sent = dispatch.delay("charger", trigger({"card": "4242"}), idempotency_key="last")
        run = wait_for(lambda: next(iter(engine.list_runs()), None), "the run to be stored")
        wait_for(lambda: engine.steps(run.id), "the first step to be saved")
        worker.popen.send_signal(signal.SIGTERM)  # the task returns as the worker drains
        assert worker.popen.wait(timeout=10) == 0
        wait_for(
            lambda: [e for e in events.of(sent.id) if e["type"] == "task-succeeded"] or None,
            "its task-succeeded event",
        )


def test_the_event_batching_arms_one_flush_and_rearms_after_a_lost_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The arming logic alone (the workers above show batches and the flush at stop):
    # one flush per batch, and a batch whose timer a reconnection dropped is not
    # left holding every later event.
    from agentruns import consumer

    class Hub:
        def __init__(self) -> None:
            self.soon: list[Any] = []

        def call_soon(self, callback: Any) -> None:
            self.soon.append(callback)

    now = [100.0]
    monkeypatch.setattr(consumer.time, "monotonic", lambda: now[0])
    c = consumer.Consumer.__new__(consumer.Consumer)
    c.hub, c._event_flush_at, c.event_dispatcher = Hub(), None, None
    c.on_send_event_buffered()
    c.on_send_event_buffered()
    assert len(c.hub.soon) == 1  # one flush armed for both
    c._flush_event_batch()
    c.on_send_event_buffered()
    assert len(c.hub.soon) == 2  # after a flush, the next event arms another
    now[0] += consumer.EVENT_BATCH_S + 0.5
    c.on_send_event_buffered()
    assert len(c.hub.soon) == 2  # late, but not lost yet
    now[0] += 1.0
    c.on_send_event_buffered()
    assert len(c.hub.soon) == 3  # its timer is gone: armed again


_FIRST_SENDS_AT_ONCE = """
import sys, threading
from agentruns.schedulers.celery import CeleryScheduler, _inside_an_eager_task
assert "celery" not in sys.modules
scheduler = CeleryScheduler(app=object())
barrier = threading.Barrier(32)
failed = []
def send():
    barrier.wait()
    try:
        scheduler._sending_app(), _inside_an_eager_task()
    except Exception as exc:
        failed.append(repr(exc))
threads = [threading.Thread(target=send) for _ in range(32)]
[t.start() for t in threads]
[t.join() for t in threads]
print(failed[:1])
sys.exit(len(failed))
"""


def test_a_producers_threads_sending_their_first_executions_at_once_all_send() -> None:
    # Which task each send is made in was asked of the celery package, whose names
    # load as they are first asked for: in a fresh process (a threaded web server
    # just started), most threads asking at once raised ImportError, after their
    # runs were stored, and the runs waited for recover().
    for _ in range(4):
        done = subprocess.run(
            [sys.executable, "-c", _FIRST_SENDS_AT_ONCE], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr
