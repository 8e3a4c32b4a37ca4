"""Redis or Postgres going away mid-run: executions abort, nothing is half-written,
and ``recover()`` finishes the runs once the service is back.

Redis is a private ``redis-server`` this test kills; Postgres is reached through
a TCP proxy this test cuts, so the shared database other tests use stays up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kombu.exceptions
import psycopg
import pytest
import redis
import sqlalchemy
import sqlalchemy.exc
from celery import Celery

from agentruns import (
    Agent,
    Budget,
    CeleryScheduler,
    Engine,
    LeaseLostError,
    LocalLeases,
    LocalScheduler,
    RedisLeases,
    RunStatus,
    SqlStore,
    ToolContext,
    tool,
)
from agentruns.celery import sweeps_queue
from agentruns.models import ScriptedModel, text, tool_use
from agentruns.outages import is_outage
from agentruns.schedulers import ManualScheduler
from agentruns.tools import Tool
from bench.cluster import Cluster
from tests.conftest import REDIS_URL, Errors, drop_connections, trigger, wait_for
from tests.support import celery_agents
from tests.support.private_redis import PrivateRedis
from tests.support.proxy import Proxy

ROOT = Path(__file__).resolve().parents[1]


@tool
def note(text: str) -> str:
    """Write a note."""
    return f"noted {text}"


SCRIPT = [tool_use("note", {"text": str(i)}) for i in range(4)] + [text("Done.")]


@pytest.fixture
def proxy() -> Iterator[Proxy]:
    p = Proxy(("127.0.0.1", 5432))
    yield p
    p.close()


def assert_finished_cleanly(engine: Engine, run_id: str) -> None:
    run = engine.get_run(run_id)
    assert run.status is RunStatus.COMPLETED, run
    steps = engine.steps(run_id)
    assert [s.index for s in steps] == list(range(len(steps)))
    assert sum(s.kind == "llm" for s in steps) == len(SCRIPT)
    # Every saved response is followed by the results of its calls: no half step.
    kinds = "".join("L" if s.kind == "llm" else "T" for s in steps)
    assert kinds == "LT" * (len(SCRIPT) - 1) + "L"


def _engine(
    url: str, leases: RedisLeases, agent: Agent, errors: Errors, lease_ttl: float = 1.0
) -> Engine:
    """An engine running its runs here, with a short lease; its errors go to ``errors``."""
    return Engine(
        SqlStore(url),
        leases=leases,
        scheduler=LocalScheduler(),
        agents=[agent],
        secret="s",
        lease_ttl=lease_ttl,
        on_error=errors.append,
    )


def _finish_recovering(engine: Engine, run_id: str, timeout: float) -> None:
    """Wait for the run to complete, recovering it meanwhile (beat's part)."""

    def finished() -> bool:
        engine.recover()
        assert engine.idle(20)
        return engine.get_run(run_id).status is RunStatus.COMPLETED

    wait_for(finished, "the run to finish", timeout=timeout)


def test_a_run_that_finds_no_free_database_connection_is_left_to_recover(
    db_url: str, redis_prefix: str, errors: Errors
) -> None:
    # A database stalled for longer than the pool's timeout (a table lock held,
    # a slow disk) keeps every connection out: a write that could get none failed
    # its run for good, with internal_error ("QueuePool limit ... reached").
    store = SqlStore(db_url, pool_size=2, pool_timeout=0.3)
    held = threading.Event()

    def stall() -> None:
        connections = []
        with contextlib.suppress(sqlalchemy.exc.TimeoutError):
            while True:
                connections.append(store.engine.connect())
        held.set()
        wait_for(lambda: errors, "the execution to give up")  # then the stall ends
        for connection in connections:
            connection.close()

    @tool
    def slow_query() -> str:
        """Start a stall of the database."""
        threading.Thread(target=stall, daemon=True).start()
        held.wait(5)
        return "started"

    agent = Agent(
        "a", ScriptedModel([tool_use("slow_query", {}), text("done")]), tools=[slow_query]
    )
    engine = Engine(
        store,
        leases=RedisLeases(prefix=redis_prefix),
        scheduler=LocalScheduler(),
        agents=[agent],
        secret="s",
        lease_ttl=1.0,
        on_error=errors.append,
    )
    try:
        run = engine.dispatch("a", trigger({}))
        assert engine.idle(20)
        assert isinstance(errors[0], sqlalchemy.exc.TimeoutError)
        left = engine.get_run(run.id)
        assert left.status is RunStatus.RUNNING and left.error is None, left.error
        _finish_recovering(engine, run.id, timeout=20)
    finally:
        engine.close()


def test_postgres_going_away_aborts_the_execution_and_recover_finishes_the_run(
    db_url: str, redis_prefix: str, proxy: Proxy, errors: Errors
) -> None:
    via_proxy = db_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    model = ScriptedModel(SCRIPT, latency_s=0.3)
    engine = _engine(
        via_proxy, RedisLeases(prefix=redis_prefix), Agent("a", model, tools=[note]), errors
    )
    direct = SqlStore(db_url)
    try:
        run = engine.dispatch("a", trigger({}))
        wait_for(lambda: len(direct.steps(run.id)) >= 2)
        proxy.cut()
        wait_for(lambda: engine.idle(0))  # the execution gave up
        assert errors.of(sqlalchemy.exc.OperationalError)
        stuck = direct.get_run(run.id)
        assert stuck.status is RunStatus.RUNNING
        partial = direct.steps(run.id)

        proxy.restore()
        wait_for(lambda: run.id in engine.recover())
        assert engine.idle(20)
        assert_finished_cleanly(engine, run.id)
        assert engine.steps(run.id)[: len(partial)] == partial
    finally:
        engine.close()
        direct.close()


@pytest.fixture
def through_proxy(db_url: str, proxy: Proxy, errors: Errors) -> Iterator[Engine]:
    """An engine through the proxy that runs its runs in this thread, when told to."""
    engine = Engine(
        SqlStore(db_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")),
        leases=LocalLeases(),
        scheduler=ManualScheduler(),
        agents=[Agent("a", ScriptedModel([text("ok")]))],
        secret="s",
        on_error=errors.append,
    )
    yield engine
    engine.close()


def test_a_create_whose_reply_was_lost_returns_the_run_it_stored(
    through_proxy: Engine, proxy: Proxy
) -> None:
    # A create is sent again when its connection was gone. The first try had
    # committed: a run with an idempotency key found it taken, but one without (no
    # trigger id: allowed) met its own id, and the dispatch raised IntegrityError
    # although its run was stored.
    engine = through_proxy
    engine.dispatch("a", trigger({"n": 0}))  # prepares the statement on a connection
    for fields in ({}, {"id": "evt-1"}):
        proxy.lose_reply_to(b"agentruns_create")
        run = engine.dispatch("a", trigger({"n": 1}, **fields))
        assert run.status is RunStatus.QUEUED
        assert engine.store.get_run(run.id) == run
    assert len(engine.list_runs()) == 3
    assert engine.execute(run.id).status is RunStatus.COMPLETED


def test_a_claim_whose_connection_breaks_before_the_server_has_it_is_sent_again(
    through_proxy: Engine, proxy: Proxy, errors: Errors
) -> None:
    # The claim met a connection that broke in flight: the execution raised, and its
    # run waited for recover(). A claim is sent once more on a new connection.
    engine = through_proxy
    run = engine.dispatch("a", trigger({}))
    proxy.hold()  # the claim waits in the proxy and never reaches the server
    breaks = threading.Timer(0.3, proxy.drop)
    breaks.start()
    assert engine.execute(run.id).status is RunStatus.COMPLETED
    breaks.join()
    assert errors == []


def test_a_claim_whose_reply_was_lost_executes_its_run(
    through_proxy: Engine, proxy: Proxy, errors: Errors
) -> None:
    # The claim committed and its reply was lost. Sent again, it found the run no
    # longer queued: the run stayed running, claimed by this engine but executed by
    # none, until its claim expired and recover() took it.
    engine = through_proxy
    engine.execute(engine.dispatch("a", trigger({"n": 0})).id)  # prepares the claim
    run = engine.dispatch("a", trigger({"n": 1}))
    proxy.lose_reply_to(b"agentruns_claim")
    done = engine.execute(run.id)
    assert done.status is RunStatus.COMPLETED, done
    assert errors == []


def test_a_claimed_create_whose_reply_was_lost_executes_its_run(
    through_proxy: Engine, proxy: Proxy, errors: Errors
) -> None:
    # A run a worker stores already claimed, whose create committed and whose reply
    # was lost: sent again, the create found the run's key (or id) taken and the run
    # went the way of a duplicate, left running until its claim expired.
    engine = through_proxy
    engine.dispatch_here("a", trigger({"n": 0}))  # prepares the statement
    for fields in ({}, {"id": "evt-1"}):
        proxy.lose_reply_to(b"agentruns_create")
        run = engine.dispatch_here("a", trigger({"n": 1}, **fields))
        assert run.status is RunStatus.COMPLETED, run
        assert [s.kind for s in engine.steps(run.id)] == ["llm"]
    assert len(engine.list_runs()) == 3
    # A key another run holds is still that run's: it is not taken for this one's.
    again = engine.dispatch_here("a", trigger({"n": 2}, id="evt-1"))
    assert again.id == run.id
    assert errors == []


def test_an_effects_result_is_recorded_across_a_dropped_connection_and_not_repeated(
    db_url: str, redis_prefix: str, errors: Errors
) -> None:
    # The connections died while the tool ran (a restart, a killed backend): the
    # first write after it, the result's record, failed, and recovery found an
    # intent without a result: the tool was called a second time.
    paid: list[str] = []

    @tool(effect=True)
    def pay(amount: int, ctx: ToolContext) -> str:
        """Pay."""
        paid.append(ctx.idempotency_key)
        with psycopg.connect(db_url.replace("+psycopg", ""), autocommit=True) as killer:
            killer.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        return f"paid {amount}"

    model = ScriptedModel([tool_use("pay", {"amount": 5}), text("Paid.")])
    engine = _engine(
        db_url, RedisLeases(prefix=redis_prefix), Agent("a", model, tools=[pay]), errors
    )
    try:
        run = engine.dispatch("a", trigger({}))
        assert engine.idle(20)
        # What followed the record may have met a dead connection too.
        _finish_recovering(engine, run.id, timeout=30)
        assert len(paid) == 1, paid
    finally:
        engine.close()


def _paying_through(
    proxy: Proxy, db_url: str, redis_prefix: str, errors: Errors, pay: Tool, lease_ttl: float
) -> Engine:
    """An engine on the database through ``proxy`` whose agent pays 5 with ``pay``."""
    via_proxy = db_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    model = ScriptedModel([tool_use("pay", {"amount": 5}), text("Paid.")])
    agent = Agent("a", model, tools=[pay])
    return _engine(via_proxy, RedisLeases(prefix=redis_prefix), agent, errors, lease_ttl=lease_ttl)


def test_an_effects_result_is_recorded_after_a_first_try_that_failed_slowly(
    db_url: str,
    redis_prefix: str,
    proxy: Proxy,
    errors: Errors,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The tries' few seconds were counted from the first try: one that waited on a
    # silent server longer than that was the only one, and the tool ran again.
    paid: list[str] = []

    @tool(effect=True)
    def pay(amount: int, ctx: ToolContext) -> str:
        """Pay."""
        paid.append(ctx.idempotency_key)
        proxy.hold()  # Postgres goes silent; 5 s later its connections drop

        def drop() -> None:
            proxy.cut()
            proxy.restore()

        threading.Timer(5.0, drop).start()
        return f"paid {amount}"

    engine = _paying_through(proxy, db_url, redis_prefix, errors, pay, lease_ttl=20)
    try:
        run = engine.dispatch("a", trigger({}))
        wait_for(lambda: engine.idle(0), "the execution", timeout=30)
        _finish_recovering(engine, run.id, timeout=60)
        assert len(paid) == 1, paid
        # Each try again says whose result it is (it named neither run nor call).
        said = f"run {run.id}: could not record the result of effect call toolu_"
        assert said in caplog.text
    finally:
        engine.close()


def test_a_lease_whose_claim_could_not_be_renewed_lapses_though_its_execution_is_stuck(
    db_url: str, redis_prefix: str, proxy: Proxy, errors: Errors
) -> None:
    # Postgres cut off from one worker whose execution was stuck (a tool that does
    # not heed ctx.signal; a statement on a server gone silent): each renewal renewed
    # the Redis lease and failed on the claim, for as long as the execution was stuck,
    # so no other worker could take the run; and recover took it for lost with its
    # worker (counted towards holding it back) though the worker lived.
    release = threading.Event()

    @tool
    def stuck(ctx: ToolContext) -> str:
        """Take long, deaf to the signal."""
        proxy.cut()
        release.wait(30)
        return "late"

    agent = Agent("a", ScriptedModel([tool_use("stuck", {}), text("Done.")]), tools=[stuck])
    via_proxy = db_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    leases = RedisLeases(prefix=redis_prefix)
    engine = _engine(via_proxy, leases, agent, errors)
    direct = SqlStore(db_url)
    try:
        run = engine.dispatch("a", trigger({}))
        wait_for(lambda: errors.of(sqlalchemy.exc.OperationalError), "a renewal to fail")
        # The lease (1 s) lapses, though the execution is still stuck in the tool.
        wait_for(lambda: leases.holder(run.id) is None, "the lease to lapse", timeout=5)
        ref = direct.run_ref(run.id)
        assert ref is not None and ref.status is RunStatus.RUNNING
        assert leases.given_up(run.id, ref.epoch)  # by a live worker: no crash
        assert not engine.idle(0) and not release.is_set()
        time.sleep(1.5)
        assert leases.holder(run.id) is None  # and is renewed no more
        assert len(errors.of(sqlalchemy.exc.OperationalError)) == 1  # said once
        # Requeued while the execution is still stuck here: this engine does not take
        # the run (as the stuck one ended, it let go of the new one's lease and keeping,
        # under the same name); another engine may.
        proxy.restore()
        assert run.id in engine.recover()
        time.sleep(1.0)
        again = direct.run_ref(run.id)
        assert again is not None and again.status is RunStatus.QUEUED, again
        assert again.epoch == ref.epoch and leases.holder(run.id) is None
    finally:
        release.set()
        proxy.restore()
        engine.close()
        direct.close()


def test_a_lease_whose_renewal_failed_once_is_kept_while_its_effect_call_goes_on(
    db_url: str, redis_prefix: str, errors: Errors
) -> None:
    # A blip of Redis under a second failed one renewal: the lease was renewed no
    # more and lapsed while the effect's call (deaf to ctx.signal) went on, and
    # another worker made the call again, at the same time.
    host, port = urllib.parse.urlsplit(REDIS_URL).netloc.split(":")
    redis_proxy = Proxy((host, int(port)))
    paid: list[str] = []
    release = threading.Event()

    @tool(effect=True)
    def pay(amount: int, ctx: ToolContext) -> str:
        """Pay."""
        paid.append(ctx.idempotency_key)
        release.wait(30)
        return "paid"

    agent = Agent("a", ScriptedModel([tool_use("pay", {"amount": 5}), text("Done.")]), tools=[pay])
    leases_url = REDIS_URL.replace(f"{host}:{port}", f"{host}:{redis_proxy.port}")
    leases = RedisLeases(leases_url, prefix=redis_prefix)
    engine = _engine(db_url, leases, agent, errors, lease_ttl=3.0)
    direct = RedisLeases(REDIS_URL, prefix=redis_prefix)
    try:
        run = engine.dispatch("a", trigger({}))
        wait_for(lambda: paid, "the call")
        redis_proxy.cut()
        wait_for(lambda: errors.of(redis.exceptions.ConnectionError), "a renewal to fail")
        redis_proxy.restore()
        deadline = time.monotonic() + 4.5  # past the lease's TTL from the failed renewal
        while time.monotonic() < deadline:
            assert direct.holder(run.id) == engine.owner  # renewed again: nobody else takes it
            time.sleep(0.1)
        release.set()
        wait_for(lambda: engine.idle(0), "the aborted execution to end")
        _finish_recovering(engine, run.id, timeout=20)
        assert len(paid) == 1  # the next execution found its record
    finally:
        release.set()
        engine.close()
        direct.close()
        redis_proxy.close()


def test_redis_going_away_aborts_the_execution_and_recover_finishes_the_run(
    db_url: str, private_redis: PrivateRedis, errors: Errors
) -> None:
    model = ScriptedModel(SCRIPT, latency_s=0.3)
    leases = RedisLeases(private_redis.url, prefix="outage")
    engine = _engine(db_url, leases, Agent("a", model, tools=[note]), errors)
    try:
        run = engine.dispatch("a", trigger({}))
        wait_for(lambda: len(engine.steps(run.id)) >= 2)
        private_redis.kill()
        wait_for(lambda: engine.idle(0))  # the renewal failed: the execution aborted
        assert engine.get_run(run.id).status is RunStatus.RUNNING
        calls_before = len(model.calls)
        time.sleep(0.5)
        assert len(model.calls) == calls_before  # nothing runs without a lease

        private_redis.start()
        wait_for(lambda: run.id in engine.recover())
        assert engine.idle(20)
        assert_finished_cleanly(engine, run.id)
    finally:
        engine.close()


def test_a_stalled_redis_delays_neither_a_timeout_nor_the_stop_of_an_unrenewed_lease(
    db_url: str, private_redis: PrivateRedis, errors: Errors
) -> None:
    # Redis stops answering (SIGSTOP): a renewal then waits out its socket timeout.
    def run_with(budget: Budget, lease_ttl: float) -> tuple[Engine, str]:
        model = ScriptedModel([text("too late")], latency_s=8)
        leases = RedisLeases(private_redis.url, prefix=f"stall-{lease_ttl}")
        engine = _engine(db_url, leases, Agent("a", model, budget=budget), errors, lease_ttl)
        run = engine.dispatch("a", trigger({}))
        wait_for(lambda: engine.get_run(run.id).status is RunStatus.RUNNING)
        return engine, run.id

    assert private_redis.proc is not None
    # The timeout (1 s) comes while the renewal started at 0.6 s is stuck.
    engine, run_id = run_with(Budget(timeout_s=1.0), lease_ttl=1.8)
    private_redis.proc.send_signal(signal.SIGSTOP)
    try:
        failed = wait_for(lambda: _settled(engine, run_id), "the timeout", timeout=3)
        assert failed.error is not None and failed.error.code == "timeout"
    finally:
        private_redis.proc.send_signal(signal.SIGCONT)
        engine.close()

    # No timeout: the lease, never renewed, would expire at 1.8 s; the execution stops
    # then as lost (nothing more written, the run left for recovery).
    engine, run_id = run_with(Budget(), lease_ttl=1.8)
    private_redis.proc.send_signal(signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        wait_for(lambda: errors.of(LeaseLostError), "the execution to stop as lost", timeout=4)
        assert time.monotonic() - stopped < 3.5  # before the stuck renewal's 5 s timeout
        assert engine.get_run(run_id).status is RunStatus.RUNNING
    finally:
        private_redis.proc.send_signal(signal.SIGCONT)
        engine.close()


def _settled(engine: Engine, run_id: str) -> Any:
    run = engine.get_run(run_id)
    return run if run.status is not RunStatus.RUNNING else None


@contextlib.contextmanager
def _celery_on(
    db_url: str, broker_url: str, leases_url: str, tmp_path: Path, latency: float
) -> Iterator[tuple[Cluster, Engine]]:
    """Workers of a queue of their own on ``broker_url``, their leases on ``leases_url``,
    and an engine here whose runs go to them; all stopped at the end."""
    queue = f"agentruns-outage-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "AGENTRUNS_DATABASE_URL": db_url,
        "AGENTRUNS_REDIS_URL": leases_url,
        "AGENTRUNS_BROKER_URL": broker_url,
        "AGENTRUNS_QUEUE": queue,
        "AGENTRUNS_AGENTS": "tests.support.celery_agents",
        "AGENTRUNS_SECRET": "s",
        "AGENTRUNS_LEASE_TTL": "1",
        "AGENTRUNS_TEST_LOG": str(tmp_path / "tools.log"),
        "AGENTRUNS_TEST_LATENCY": str(latency),
        "PYTHONPATH": str(ROOT),
    }
    group = Cluster(env, queue, tmp_path)
    producer = Celery("producer", broker=broker_url)
    producer.conf.update(task_default_queue=queue, broker_connection_retry=False)
    engine = Engine(
        SqlStore(db_url),
        leases=RedisLeases(leases_url),
        scheduler=CeleryScheduler(producer),
        agents=[celery_agents.charger],
        secret="s",
        lease_ttl=1.0,
    )
    try:
        yield group, engine
    finally:
        group.stop(graceful=False)
        engine.close()


def test_beat_says_in_one_line_each_sweep_it_cannot_send_and_sends_them_after(
    db_url: str, private_redis: PrivateRedis, tmp_path: Path
) -> None:
    # While the broker was away, Celery's scheduler logged every sweep it could not
    # send with its main loop's stack and a traceback: some 170 lines a sweep.
    with _celery_on(db_url, private_redis.url, REDIS_URL, tmp_path, 0.5) as (group, _):
        group.env["AGENTRUNS_TICK_INTERVAL"] = "1"
        beat = group.beat()
        sweeps = redis.Redis.from_url(private_redis.url)
        wait_for(lambda: sweeps.llen(sweeps_queue(group.queue)) > 0, "a sweep sent")
        private_redis.kill()
        line = "WARNING/MainProcess] beat could not send agentruns.tick: OperationalError: "
        wait_for(lambda: beat.output().count(line) >= 2, "two sweeps not sent")
        assert "Traceback" not in beat.output() and "Message Error" not in beat.output()
        private_redis.start()  # empty: what was sent went with it
        sweeps = redis.Redis.from_url(private_redis.url)
        wait_for(lambda: sweeps.llen(sweeps_queue(group.queue)) > 0, "a sweep sent after")


def test_beat_takes_only_a_broker_connections_errors_for_a_send_it_could_not_make() -> None:
    # Its schedule file not written (Celery syncs it inside the send: a full disk, a
    # directory gone) was said as "could not send", though the sweep had gone out.
    from celery.beat import SchedulingError

    from agentruns.beat import _connection_error

    def raised(inner: Exception) -> Exception:
        try:
            try:
                raise inner
            except Exception:
                raise SchedulingError("Couldn't apply scheduled task agentruns.tick") from None
        except SchedulingError as exc:
            return exc

    refused = kombu.exceptions.OperationalError("Error 111 connecting to 127.0.0.1:6390")
    assert _connection_error(raised(refused)) is refused
    assert _connection_error(raised(FileNotFoundError("beat-schedule.dir"))) is None
    assert _connection_error(raised(OSError(28, "No space left on device"))) is None


def test_a_busy_worker_outlives_its_broker_going_away_and_finishes_the_run_after(
    db_url: str, private_redis: PrivateRedis, tmp_path: Path
) -> None:
    # With a run in flight (acks late: its message unacked), kombu's channel close
    # after the lost connection raised AttributeError, and the worker exited for
    # good: nothing was left to finish the run once Redis came back.
    with _celery_on(db_url, private_redis.url, private_redis.url, tmp_path, 0.5) as (
        group,
        engine,
    ):
        (worker,) = group.workers("w", concurrency=4)
        run = engine.dispatch("charger", trigger({}))
        wait_for(lambda: len(engine.steps(run.id)) >= 2, "the run under way")
        private_redis.kill()
        time.sleep(3)  # the worker notices, and closes its broker connection
        assert worker.alive(), worker.output()[-3000:]
        assert "Unrecoverable error" not in worker.output()

        private_redis.start()

        def finished() -> bool:
            engine.recover()  # beat's part: the worker settled the run interrupted
            return engine.get_run(run.id).status is RunStatus.COMPLETED

        wait_for(finished, "the run to finish on the same worker", timeout=60)
        assert worker.alive()
        steps = engine.steps(run.id)
        assert [s.index for s in steps] == list(range(len(steps)))


def test_runs_go_on_through_a_lost_broker_connection_when_the_leases_stay(
    db_url: str, private_redis: PrivateRedis, tmp_path: Path
) -> None:
    # The broker is a Redis of its own and goes away; the leases' Redis and Postgres
    # stay. Celery cancelled the tasks in flight (in a prefork pool, it killed their
    # processes), as if the worker had crashed: the runs waited for recover.
    with _celery_on(db_url, private_redis.url, REDIS_URL, tmp_path, 0.8) as (group, engine):
        (worker,) = group.workers("w", pool="prefork", concurrency=2)
        run = engine.dispatch("charger", trigger({}))
        wait_for(lambda: len(engine.steps(run.id)) >= 2, "the run under way")
        private_redis.kill()
        wait_for(lambda: "Connection to broker lost" in worker.output(), "the worker to notice")
        private_redis.start()
        assert engine.get_run(run.id).status is RunStatus.RUNNING  # still under way
        # No recover: the execution that was under way finishes the run.
        wait_for(
            lambda: engine.get_run(run.id).status is RunStatus.COMPLETED, "the run", timeout=30
        )
        with engine.store.engine.connect() as conn:
            epoch = conn.execute(
                sqlalchemy.text("SELECT epoch FROM agentruns_runs WHERE id = :id"), {"id": run.id}
            ).scalar_one()
        assert epoch == 1  # claimed once: never interrupted
        # Its task's message was acked on the connection that came back ("Couldn't
        # ack", CRITICAL, and a redelivery an hour later, when it was not).
        assert "CRITICAL" not in worker.output(), worker.output()[-3000:]


def test_an_effects_result_is_recorded_through_an_outage_of_seconds(
    db_url: str, redis_prefix: str, proxy: Proxy, errors: Errors
) -> None:
    # Postgres away for 10 s while the tool ran (a failover, a restart): the result's
    # record was given up after 4 s, though the worker held the result and its lease,
    # and the call was made again once the database was back.
    paid: list[str] = []
    back = threading.Timer(10.0, proxy.restore)

    @tool(effect=True)
    def pay(amount: int, ctx: ToolContext) -> str:
        """Pay."""
        paid.append(ctx.idempotency_key)
        if len(paid) == 1:
            proxy.cut()
            back.start()
        return f"paid {amount}"

    engine = _paying_through(proxy, db_url, redis_prefix, errors, pay, lease_ttl=30)
    try:
        run = engine.dispatch("a", trigger({}))
        wait_for(lambda: engine.idle(0), "the execution", timeout=60)
        back.join()
        _finish_recovering(engine, run.id, timeout=60)
        assert len(paid) == 1, paid
        (record,) = engine.store.effects(run.id).values()
        assert record.done and record.result == "paid 5"
    finally:
        engine.close()


def test_an_effects_intent_whose_reply_was_lost_is_not_taken_for_an_unknown_outcome(
    through_proxy: Engine, proxy: Proxy, errors: Errors
) -> None:
    # The intent committed and its reply was lost: the execution aborted, and the next
    # one took the call for one that may have happened (with on_unknown="fail", the
    # run failed effect_outcome_unknown), though the tool was never called.
    paid: list[str] = []

    @tool(effect=True, on_unknown="fail")
    def pay(amount: int) -> str:
        """Pay."""
        paid.append("pay")
        return f"paid {amount}"

    engine = through_proxy
    model = ScriptedModel([tool_use("pay", {"amount": 5}), text("Paid.")])
    engine.register(Agent("p", model, tools=[pay]))
    run = engine.dispatch("p", trigger({}))
    proxy.lose_reply_to(b"COMMIT\x00")  # the first transaction of its own: the intent's
    done = engine.execute(run.id)
    assert done.status is RunStatus.COMPLETED, done.error
    assert paid == ["pay"] and errors == []


class _EndingNewConnections:
    """Ends the server side of each connection ``url``'s store opens, as it is opened,
    ``times`` times once armed (``pg_terminate_backend`` in a loop, a failover under
    way), and waits until the server has closed it."""

    def __init__(self, store: SqlStore, url: str, times: int) -> None:
        self.url = url.replace("+psycopg", "")
        self.left = 0
        self.times = times
        sqlalchemy.event.listen(store.engine, "connect", self._opened)

    def arm(self) -> None:
        self.left = self.times

    def _opened(self, dbapi_conn: psycopg.Connection[Any], _record: Any) -> None:
        if self.left <= 0:
            return
        self.left -= 1
        pid = dbapi_conn.info.backend_pid
        with psycopg.connect(self.url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
                time.sleep(0.005)


def test_an_effects_result_is_recorded_though_the_connections_opened_for_it_are_ended(
    db_url: str, redis_prefix: str, errors: Errors
) -> None:
    # SQLAlchemy's checkout replaces an ended connection once, then raises
    # InvalidRequestError ("This connection is closed"), which was not taken for an
    # outage: the run failed internal_error, and a retry called the effect again.
    paid: list[str] = []
    store = SqlStore(db_url)
    ending = _EndingNewConnections(store, db_url, times=3)

    @tool(effect=True)
    def pay(amount: int, ctx: ToolContext) -> str:
        """Pay."""
        paid.append(ctx.idempotency_key)
        drop_connections(db_url)
        ending.arm()
        return f"paid {amount}"

    model = ScriptedModel([tool_use("pay", {"amount": 5}), text("Paid.")])
    engine = Engine(
        store,
        leases=RedisLeases(prefix=redis_prefix),
        scheduler=LocalScheduler(),
        agents=[Agent("a", model, tools=[pay])],
        secret="s",
        on_error=errors.append,
    )
    try:
        run = engine.dispatch("a", trigger({}))
        assert engine.idle(20)
        assert engine.get_run(run.id).status is RunStatus.COMPLETED, engine.get_run(run.id)
        assert len(paid) == 1 and ending.left == 0
        assert errors == []
    finally:
        engine.close()


def test_a_store_whose_every_new_connection_is_ended_raises_an_outage(db_url: str) -> None:
    store = SqlStore(db_url)
    ending = _EndingNewConnections(store, db_url, times=1000)
    try:
        store.list_runs()
        drop_connections(db_url)
        ending.arm()
        with pytest.raises(sqlalchemy.exc.DisconnectionError) as raised:
            store.list_runs()
        assert is_outage(raised.value)
        ending.left = 0
        assert store.list_runs() == []  # and it works again once the server lets it
    finally:
        store.close()
