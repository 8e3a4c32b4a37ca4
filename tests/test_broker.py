"""agentruns' Redis transport for Celery (the same transport, one Redis client per channel),
and a producer's task and ``task-sent`` event sent in one round trip."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection
from redis.connection import AbstractConnection

from agentruns import Agent, CeleryScheduler, Engine, RunStatus, SqlStore
from agentruns.broker import TRANSPORT, Transport
from agentruns.celery import _pick_transport
from agentruns.models import ScriptedModel, text, tool_use
from bench.cluster import forget_queue
from tests.conftest import REDIS_URL, EngineFactory, trigger
from tests.support.agents import publish


def _clients_made_by(transport: str | None, monkeypatch: pytest.MonkeyPatch) -> int:
    """Redis clients built while 20 messages are published, received and acked."""
    made = 0
    init = redis.Redis.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        nonlocal made
        made += 1
        init(self, *args, **kwargs)

    queue = f"agentruns-test-broker-{uuid.uuid4().hex[:8]}"
    with Connection(REDIS_URL, transport=transport) as conn:
        simple = conn.SimpleQueue(queue)
        try:
            monkeypatch.setattr(redis.Redis, "__init__", counting)
            for i in range(20):
                simple.put({"n": i})
            for _ in range(20):
                simple.get(timeout=5).ack()
            monkeypatch.setattr(redis.Redis, "__init__", init)
        finally:
            simple.clear()
            simple.close()
            forget_queue(queue, REDIS_URL)  # and its bindings, which close() leaves in Redis
    return made


def test_the_transport_builds_one_redis_client_per_channel_not_one_per_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _clients_made_by(None, monkeypatch) >= 20  # kombu's own: one per publish or ack
    assert _clients_made_by(TRANSPORT, monkeypatch) <= 2


def test_the_shared_client_follows_a_channel_that_replaced_its_pool() -> None:
    with Connection(REDIS_URL, transport=TRANSPORT) as conn:
        channel = conn.default_channel
        first = channel._create_client()
        assert channel._create_client() is first
        channel._pool = None  # as after a disconnect
        second = channel._create_client()
        assert second is not first and second.connection_pool is channel.pool
        assert second.ping()


@pytest.mark.parametrize(
    ("broker_url", "configured", "chosen"),
    [
        ("redis://localhost:6379/0", None, TRANSPORT),
        ("rediss://localhost:6380/0", None, TRANSPORT),
        ("amqp://guest@localhost//", None, None),  # another broker keeps Celery's transport
        ("redis://localhost:6379/0", "redis", "redis"),  # an explicit choice stands
    ],
)
def test_a_redis_broker_gets_the_transport_unless_the_configuration_says_otherwise(
    broker_url: str, configured: str | None, chosen: str | None
) -> None:
    app = Celery("pick", set_as_current=False)
    app.on_after_configure.connect(_pick_transport)
    app.conf.update(broker_url=broker_url, broker_transport=configured)
    assert app.conf.broker_transport == chosen


def test_the_agentruns_app_connects_through_it() -> None:
    from agentruns.celery import app

    assert str(app.conf.broker_url).startswith("redis://")  # the default, and the tests'
    with app.connection_for_write() as conn:
        assert isinstance(conn.transport, Transport)


# -- a task and its task-sent event, sent together ----------------------------------------


@pytest.fixture
def queue() -> Iterator[str]:
    """``agentruns.celery.app`` sending to a queue of this test's own (no worker reads it)."""
    from agentruns.celery import app

    name = f"agentruns-test-broker-{uuid.uuid4().hex[:8]}"
    before = {"broker_url": app.conf.broker_url, "task_default_queue": app.conf.task_default_queue}
    app.conf.update(broker_url=REDIS_URL, task_default_queue=name)
    try:
        yield name
    finally:
        app.conf.update(before)
        forget_queue(name, REDIS_URL)


class RoundTrips:
    """What this process sends to Redis, one entry per round trip (a pipeline is one)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[bytes] = []
        original = AbstractConnection.send_packed_command

        def spy(conn: Any, command: Any, check_health: bool = True) -> None:
            parts = [command] if isinstance(command, bytes | str) else list(command)
            chunks = (p.encode() if isinstance(p, str) else bytes(p) for p in parts)
            self.sent.append(b"".join(chunks))
            original(conn, command, check_health)

        monkeypatch.setattr(AbstractConnection, "send_packed_command", spy)


def _queued_ids(queue: str) -> list[str]:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        return [json.loads(m)["headers"]["id"] for m in client.lrange(queue, 0, -1)]
    finally:
        client.close()


def test_a_task_and_its_sent_event_reach_redis_in_one_round_trip(
    queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery import Task

    from agentruns.tasks import dispatch

    assert dispatch.app.conf.task_send_sent_event
    dispatch.delay("quick", trigger({}), idempotency_key="warm")  # connects
    trips = RoundTrips(monkeypatch)
    sent = dispatch.delay("quick", trigger({}), idempotency_key="together")
    assert len(trips.sent) == 1
    assert b"LPUSH" in trips.sent[0] and b"PUBLISH" in trips.sent[0]
    # Celery's own apply_async, for comparison: the message, then the event.
    trips.sent.clear()
    alone = Task.apply_async(dispatch, ("quick", trigger({})), {"idempotency_key": "apart"})
    assert [b"LPUSH" in s for s in trips.sent] == [True, False]
    assert _queued_ids(queue)[::-1][1:] == [sent.id, alone.id]


def test_a_failed_batch_is_sent_again_under_the_same_task_id(
    queue: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whether a failed pipeline reached Redis is unknown: the task is sent again,
    the usual way, with the id its caller gets back (a copy is only a duplicate)."""
    from agentruns.tasks import dispatch

    execute = redis.client.Pipeline.execute
    failures: list[int] = []

    def failing_once(pipe: Any, raise_on_error: bool = True) -> Any:
        if not failures:
            failures.append(1)
            raise redis.ConnectionError("the pipeline broke")
        return execute(pipe, raise_on_error)

    warm = dispatch.delay("quick", trigger({}), idempotency_key="warm")  # connects
    monkeypatch.setattr(redis.client.Pipeline, "execute", failing_once)
    sent = dispatch.delay("quick", trigger({}), idempotency_key="again")
    assert failures == [1]
    assert _queued_ids(queue) == [sent.id, warm.id]
    assert "sending it again" in caplog.text


def test_the_schedulers_execute_nudge_goes_in_one_round_trip_too(
    queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentruns import CeleryScheduler
    from agentruns.celery import app

    scheduler = CeleryScheduler(app)
    scheduler.schedule("run-warm")
    trips = RoundTrips(monkeypatch)
    scheduler.schedule("run-1")
    assert len(trips.sent) == 1 and b"LPUSH" in trips.sent[0] and b"PUBLISH" in trips.sent[0]
    assert len(_queued_ids(queue)) == 2


def test_the_scheduler_counts_the_nudges_waiting_in_its_queue(queue: str) -> None:
    # What recover() asks before it nudges queued runs again (see the engine's test).
    from agentruns import CeleryScheduler
    from agentruns.celery import app

    scheduler = CeleryScheduler(app)
    assert scheduler.waiting() == 0  # no such queue yet
    for n in range(3):
        scheduler.schedule(f"run-{n}")
    assert scheduler.waiting() == 3


def test_a_callers_batch_sends_many_dispatches_in_one_round_trip(
    queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside a batch the caller holds (README, "Producers"), dispatches wait for it:
    they go out together when it closes, not one round trip each."""
    from agentruns.tasks import dispatch

    dispatch.delay("quick", trigger({}), idempotency_key="warm")  # connects
    trips = RoundTrips(monkeypatch)
    with dispatch.app.producer_or_acquire() as producer, producer.batch():
        sent = [
            dispatch.apply_async(("quick", trigger({"n": i})), producer=producer).id
            for i in range(10)
        ]
        assert trips.sent == []
    assert len(trips.sent) == 1 and trips.sent[0].count(b"LPUSH") == 10
    assert _queued_ids(queue)[::-1][1:] == sent


def test_an_eager_task_runs_here_and_sends_nothing(
    queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``task_always_eager`` (a test setup's choice), a task runs in the caller,
    as Celery's would: no batch is opened and nothing reaches Redis."""
    from agentruns import tasks

    ticked: list[bool] = []

    class Engine:
        def tick(self, *, wait_for_notifiers: bool = True) -> None:
            ticked.append(wait_for_notifiers)

    monkeypatch.setattr(tasks, "get_engine", lambda app: Engine())
    monkeypatch.setitem(tasks.app.conf, "task_always_eager", True)
    trips = RoundTrips(monkeypatch)
    result = tasks.tick.delay()
    assert result.successful() and ticked == [False]  # a task waits for no notifier
    assert trips.sent == [] and _queued_ids(queue) == []


def test_an_eager_app_runs_the_executions_its_scheduler_sends_here(
    queue: str, make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``task_always_eager``, an answered approval's run, and the run its thread
    held back meanwhile, run in the caller too: sent by name (``send_task``, which
    ignores eager mode), they waited in the broker for a worker, and stayed queued."""
    from agentruns import tasks

    asks = Agent(
        "asks", ScriptedModel([tool_use("publish", {"text": "hi"}), text("Done.")]), tools=[publish]
    )
    engine = make_engine([asks], scheduler=CeleryScheduler(tasks.app))
    monkeypatch.setattr(tasks, "get_engine", lambda app: engine)  # the worker's engine
    monkeypatch.setitem(tasks.app.conf, "task_always_eager", True)
    first = engine.get_run(tasks.dispatch.delay("asks", trigger({}), thread="t").get())
    assert first.status is RunStatus.WAITING
    held = engine.dispatch("asks", trigger({}), thread="t")  # behind the waiting run
    assert engine.get_run(held.id).status is RunStatus.QUEUED
    tasks.resume.delay(engine.approval_token(first.id), approved=True)
    assert engine.get_run(first.id).status is RunStatus.COMPLETED
    assert engine.get_run(held.id).status is RunStatus.COMPLETED  # the thread's next one ran
    assert _queued_ids(queue) == []


def test_an_eager_line_of_runs_runs_to_its_end_without_nesting_each_in_the_last(
    queue: str, make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each finished run scheduled its key's next, which ran inside it: a line of
    some 120 runs reached Python's recursion limit, and the rest stayed queued."""
    from agentruns import tasks

    asks = Agent(
        "asks", ScriptedModel([tool_use("publish", {"text": "hi"}), text("Done.")]), tools=[publish]
    )
    quick = Agent("quick", ScriptedModel([text("ok")]))
    engine = make_engine([asks, quick], scheduler=CeleryScheduler(tasks.app))
    monkeypatch.setattr(tasks, "get_engine", lambda app: engine)  # the worker's engine
    monkeypatch.setitem(tasks.app.conf, "task_always_eager", True)
    first = engine.dispatch("asks", trigger({}), thread="t")
    assert engine.get_run(first.id).status is RunStatus.WAITING
    line = [engine.dispatch("quick", trigger({"n": n}), thread="t") for n in range(200)]
    tasks.resume.delay(engine.approval_token(first.id), approved=True)
    assert {engine.get_run(run.id).status for run in line} == {RunStatus.COMPLETED}
    assert _queued_ids(queue) == []


def test_a_teams_own_eager_app_runs_the_executions_its_tasks_schedule_here(
    queue: str, make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A team's own app, eager, that includes agentruns' tasks: the scheduler asked
    agentruns' app, which is not eager, and the resumed run waited in the broker."""
    from celery import Celery

    from agentruns import tasks

    asks = Agent(
        "asks", ScriptedModel([tool_use("publish", {"text": "hi"}), text("Done.")]), tools=[publish]
    )
    engine = make_engine([asks], scheduler=CeleryScheduler(tasks.app))
    monkeypatch.setattr(tasks, "get_engine", lambda app: engine)  # the worker's engine
    team = Celery("team", set_as_current=False)
    team.conf.update(task_always_eager=True, broker_url=REDIS_URL, task_default_queue=queue)
    first = engine.get_run(team.tasks[tasks.dispatch.name].delay("asks", trigger({})).get())
    assert first.status is RunStatus.WAITING
    team.tasks[tasks.resume.name].delay(engine.approval_token(first.id), approved=True)
    assert engine.get_run(first.id).status is RunStatus.COMPLETED
    assert _queued_ids(queue) == []


def test_a_teams_own_eager_app_without_redis_runs_its_tasks_in_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A team's tests: its own app, eager, on no broker (memory://) and no Redis. The
    worker's engine took its leases from agentruns' app's broker (localhost's Redis),
    and sent its executions through that app, not eager: the run stayed queued."""
    from agentruns import tasks, worker
    from agentruns.migrate import migrate
    from agentruns.settings import get_settings

    url = f"sqlite:///{tmp_path / 'team.db'}"
    migrate(url)
    for name in ("AGENTRUNS_REDIS_URL", "AGENTRUNS_BROKER_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AGENTRUNS_DATABASE_URL", url)
    monkeypatch.setenv("AGENTRUNS_AGENTS", "tests.support.agents")
    monkeypatch.setenv("AGENTRUNS_SECRET", "team-secret")
    monkeypatch.setenv("AGENTRUNS_BROKER_URL", "redis://127.0.0.1:1/0")  # nothing there
    get_settings.cache_clear()
    monkeypatch.setattr(worker, "_engine", None)
    team = Celery("team", broker="memory://", set_as_current=False)
    team.conf.task_always_eager = True
    try:
        run_id = team.tasks[tasks.dispatch.name].delay("pager", trigger({})).get()
        engine = worker.get_engine(team)
        assert engine.get_run(run_id).status is RunStatus.WAITING
        team.tasks[tasks.resume.name].delay(engine.approval_token(run_id), True).get()
        assert engine.get_run(run_id).status is RunStatus.COMPLETED
    finally:
        if worker._engine is not None:
            worker._engine.close()
        get_settings.cache_clear()


def test_a_teams_tests_build_the_engine_again_once_their_settings_are_mended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside a worker, a build that failed is not remembered: a worker tries its
    agent modules again only every so often, and a team's test that mends its
    settings got the old error for as long."""
    from agentruns import worker
    from agentruns.errors import AgentrunsError
    from agentruns.migrate import migrate
    from agentruns.settings import get_settings

    url = f"sqlite:///{tmp_path / 'team.db'}"
    migrate(url)
    for name in ("AGENTRUNS_REDIS_URL", "AGENTRUNS_BROKER_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AGENTRUNS_DATABASE_URL", url)
    monkeypatch.setenv("AGENTRUNS_SECRET", "team-secret")
    monkeypatch.setattr(worker, "_engine", None)
    team = Celery("team", broker="memory://", set_as_current=False)
    team.conf.task_always_eager = True
    try:
        monkeypatch.setenv("AGENTRUNS_AGENTS", "tests.support.broken_agents")
        get_settings.cache_clear()
        with pytest.raises(AgentrunsError, match="cannot import the agent modules"):
            worker.get_engine(team)
        monkeypatch.setenv("AGENTRUNS_AGENTS", "tests.support.agents")
        get_settings.cache_clear()
        assert "pager" in worker.get_engine(team).agents
    finally:
        if worker._engine is not None:
            worker._engine.close()
        get_settings.cache_clear()


def test_executions_scheduled_inside_a_teams_task_go_through_the_teams_app(queue: str) -> None:
    """An engine built on agentruns' app (its first caller asked for none) sent the
    executions it scheduled in a team's worker to AGENTRUNS_QUEUE, which no worker of
    the team's consumes. They follow the app of the task they are scheduled in."""
    from celery._state import _task_stack

    from agentruns import tasks

    theirs = f"{queue}.team"
    team = Celery("team", broker=REDIS_URL, set_as_current=False)
    team.conf.task_default_queue = theirs
    scheduler = CeleryScheduler(tasks.app)
    try:
        scheduler.schedule("outside")  # in no task: the scheduler's own app
        _task_stack.push(team.tasks[tasks.execute.name])  # as its worker runs it
        try:
            scheduler.schedule("inside")
        finally:
            _task_stack.pop()
        assert len(_queued_ids(queue)) == 1 and len(_queued_ids(theirs)) == 1
    finally:
        forget_queue(theirs, REDIS_URL)


def test_an_eager_task_fails_on_an_outage_instead_of_retrying_in_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An eager retry runs the task again at once, inside itself: retrying an
    unmigrated database (or an outage) that way ended in a RecursionError."""
    from agentruns import tasks
    from agentruns.errors import NotMigratedError

    def engine(app: Any) -> Engine:  # the worker's engine, on a database never migrated
        return Engine(SqlStore(f"sqlite:///{tmp_path / 'new.db'}"), secret="s")

    monkeypatch.setattr(tasks, "get_engine", engine)
    monkeypatch.setitem(tasks.app.conf, "task_always_eager", True)
    result = tasks.dispatch.delay("quick", trigger({}))
    assert result.failed()
    assert isinstance(result.result, NotMigratedError), result.result


def test_a_dispatch_that_fails_inside_a_callers_batch_leaves_the_rest_of_it(
    queue: str,
) -> None:
    """Arguments that are not JSON fail their own dispatch; the caller's batch still
    sends the dispatches around it (kombu's nested batches would abort it all)."""
    from kombu.exceptions import EncodeError

    from agentruns import Budget
    from agentruns.errors import InvalidTriggerError
    from agentruns.tasks import dispatch

    with dispatch.app.producer_or_acquire() as producer, producer.batch():
        before = dispatch.apply_async(("quick", trigger({})), producer=producer).id
        with pytest.raises(EncodeError):  # a valid budget, but not as JSON
            budget = {"budget": Budget(max_steps=3)}
            dispatch.apply_async(("quick", trigger({})), budget, producer=producer)
        with pytest.raises(InvalidTriggerError):  # refused before it is encoded
            dispatch.apply_async(("quick", trigger({"at": object()})), producer=producer)
        after = dispatch.apply_async(("quick", trigger({})), producer=producer).id
    assert _queued_ids(queue)[::-1] == [before, after]


def test_a_broker_without_publish_batches_gets_each_send_at_once() -> None:
    """Only kombu's Redis transport batches; on another broker a send goes out
    inside ``send_together`` at once, as Celery's own would."""
    from agentruns.broker import send_together

    app = Celery("elsewhere", broker="memory://", set_as_current=False)
    app.conf.task_send_sent_event = True
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue("celery")
        arrived: list[str] = []

        def send(producer: Any, task_id: str) -> Any:
            sent = app.send_task("t", producer=producer, task_id=task_id)
            arrived.append(queue.get(timeout=1).headers["id"])  # before send_together returns
            return sent

        try:
            sent = send_together(app, send)
            assert arrived == [sent.id]
        finally:
            queue.close()


def test_forgetting_a_queue_leaves_none_of_its_keys(queue: str) -> None:
    from agentruns.tasks import dispatch

    dispatch.delay("nobody", {"source": "s", "trigger": "t", "payload": {}})
    client = redis.Redis.from_url(REDIS_URL)
    try:
        assert any(queue in key.decode() for key in client.scan_iter(f"*{queue}*"))
        forget_queue(queue, REDIS_URL)
        assert list(client.scan_iter(f"*{queue}*")) == []
    finally:
        client.close()
