"""``Engine.retry`` and ``agentruns retry``: a failed run goes on from its latest
checkpoint, its saved work and its effects not repeated."""

from __future__ import annotations

import pickle
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from agentruns import (
    Agent,
    Budget,
    Engine,
    FatalToolError,
    Run,
    RunNotFoundError,
    RunStatus,
    tool,
)
from agentruns.errors import InvalidTriggerError, NotRetryableError, UnknownAgentError
from agentruns.models import ScriptedModel, text, tool_use
from agentruns.models.base import ModelError, ModelRequest, ModelResponse
from agentruns.runs import RunError, utcnow
from agentruns.schedulers import ManualScheduler
from agentruns.store import schema
from agentruns.store.base import Commit, Guard
from tests.conftest import EngineFactory, trigger


class _DownOnce(ScriptedModel):
    """A scripted model whose call at ``turn`` fails while ``down`` is set (the
    provider's outage outlasting the retries)."""

    def __init__(self, script: list[Any], turn: int) -> None:
        super().__init__(script)
        self.turn = turn
        self.down = threading.Event()
        self.down.set()

    def complete(self, request: ModelRequest, signal: threading.Event) -> ModelResponse:
        turn = sum(1 for m in request.messages if m.get("role") == "assistant")
        if turn == self.turn and self.down.is_set():
            raise ModelError("overloaded_error: Overloaded (529), 4 retries")
        return super().complete(request, signal)


def _made(calls: list[str]) -> tuple[Any, Any]:
    @tool
    def look(what: str) -> str:
        """Look something up."""
        calls.append(f"look:{what}")
        return f"found {what}"

    @tool(effect=True)
    def charge(cents: int) -> str:
        """Charge the customer."""
        calls.append(f"charge:{cents}")
        return f"charged {cents}"

    return look, charge


def test_a_run_failed_by_the_model_goes_on_from_its_checkpoint_when_retried(
    make_any_engine: EngineFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # A run failed with model_error after an outage of the provider was a dead end: a
    # new dispatch (with another idempotency key) made every call again, the charge too.
    calls: list[str] = []
    look, charge = _made(calls)
    model = _DownOnce(
        [tool_use("look", {"what": "order"}), tool_use("charge", {"cents": 500}), text("done")],
        turn=2,
    )
    engine = make_any_engine([Agent("a", model, tools=[look, charge])], scheduler=ManualScheduler())
    run = engine.dispatch("a", trigger({}), schedule=False)
    failed = engine.execute(run.id)
    assert failed.status is RunStatus.FAILED and failed.error is not None
    assert failed.error.code == "model_error"
    before = engine.steps(run.id)
    model.down.clear()  # the provider is back

    with caplog.at_level("INFO", logger="agentruns"):
        retried = engine.retry(run.id)
    assert retried.status is RunStatus.QUEUED and retried.error is None
    # The failure it clears is said where an operator looks.
    said = f"run {run.id} queued again after it failed (model_error: overloaded_error: Overl"
    assert said in caplog.text
    assert retried.finished_at is None
    assert engine.scheduler.scheduled == [run.id]  # type: ignore[attr-defined]
    done = engine.execute(run.id)
    assert done.status is RunStatus.COMPLETED and done.output == "done"
    assert calls == ["look:order", "charge:500"]  # nothing made twice
    steps = engine.steps(run.id)
    assert steps[: len(before)] == before
    assert [s.kind for s in steps[len(before) :]] == ["llm"]
    assert done.steps_used == 3
    transcript = [m["role"] for m in engine.checkpoint(run.id).messages]  # type: ignore[union-attr]
    assert transcript == ["user", "assistant", "user", "assistant", "user", "assistant"]


def test_a_retry_does_not_make_again_the_calls_done_before_a_fatal_one(
    make_any_engine: EngineFactory,
) -> None:
    # The calls of the step made before the one that failed the run had their step
    # rows saved but not their results: a retry made them again, their rows twice.
    calls: list[str] = []
    look, charge = _made(calls)
    broken = threading.Event()
    broken.set()

    @tool
    def ticket() -> str:
        """Open a ticket."""
        calls.append("ticket")
        if broken.is_set():
            raise FatalToolError("the tracker is gone")
        return "ticket 7"

    step = [
        tool_use("look", {"what": "order"}),
        tool_use("charge", {"cents": 500}),
        tool_use("ticket", {}),
    ]
    agent = Agent("a", ScriptedModel([step, text("done")]), tools=[look, charge, ticket])
    engine = make_any_engine([agent], scheduler=ManualScheduler())
    run = engine.dispatch("a", trigger({}), schedule=False)
    failed = engine.execute(run.id)
    assert failed.error is not None and failed.error.code == "fatal_tool_error"
    assert calls == ["look:order", "charge:500", "ticket"]
    broken.clear()  # the tracker is back

    engine.retry(run.id)
    done = engine.execute(run.id)
    assert done.status is RunStatus.COMPLETED
    assert calls == ["look:order", "charge:500", "ticket", "ticket"]
    tool_steps = [(s.name, s.error is not None) for s in engine.steps(run.id) if s.kind == "tool"]
    assert tool_steps == [("look", False), ("charge", False), ("ticket", True), ("ticket", False)]
    results = engine.checkpoint(run.id).messages[2]["content"]  # type: ignore[union-attr]
    assert [r["content"] for r in results] == ["found order", "charged 500", "ticket 7"]


def test_only_a_failed_run_is_retried_and_a_queued_one_is_nudged(
    make_any_engine: EngineFactory,
) -> None:
    engine = make_any_engine([Agent("a", ScriptedModel([text("ok")]))], scheduler=ManualScheduler())
    done = engine.dispatch("a", trigger({"n": 1}), schedule=False)
    engine.execute(done.id)
    with pytest.raises(NotRetryableError, match="is completed: only a failed"):
        engine.retry(done.id)
    assert engine.get_run(done.id).status is RunStatus.COMPLETED
    # Queued already: a retry whose first try committed though its reply was lost (the
    # task tries again through an outage) was refused, and the run waited for recover.
    queued = engine.dispatch("a", trigger({"n": 2}), schedule=False)
    assert engine.retry(queued.id).status is RunStatus.QUEUED
    assert engine.scheduler.scheduled == [queued.id]  # type: ignore[attr-defined]
    assert engine.get_run(queued.id).updated_at == queued.updated_at  # unchanged


def test_two_retries_at_once_queue_the_run_once(make_engine: EngineFactory) -> None:
    def broken() -> str:
        raise FatalToolError("no")

    agent = Agent("a", ScriptedModel([tool_use("broken", {}), text("ok")]), tools=[tool(broken)])
    engine = make_engine([agent], scheduler=ManualScheduler())
    run = engine.dispatch("a", trigger({}), schedule=False)
    assert engine.execute(run.id).status is RunStatus.FAILED
    queued: list[str] = []
    engine.on(
        "run.updated", lambda e: queued.append(e.run.id) if e.run.status.value == "queued" else None
    )
    barrier = threading.Barrier(4)

    def retry() -> None:
        barrier.wait()
        assert engine.retry(run.id).status is RunStatus.QUEUED

    threads = [threading.Thread(target=retry) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert queued == [run.id]  # one of them queued it; the others nudged it
    assert engine.scheduler.scheduled == [run.id] * 4  # type: ignore[attr-defined]
    assert engine.execute(run.id).status is RunStatus.FAILED  # (still broken)


def test_a_retry_request_is_answered_once_however_often_it_comes(
    make_any_engine: EngineFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # The retry task's message delivered again (its worker died before it acked, or
    # it retried an outage after a first try that went through) queued again a run
    # that had failed once more since: a retry nobody asked for.
    calls: list[str] = []

    @tool
    def broken() -> str:
        calls.append("broken")
        raise FatalToolError("no")

    agent = Agent("a", ScriptedModel([tool_use("broken", {}), text("ok")]), tools=[broken])
    engine = make_any_engine([agent], scheduler=ManualScheduler())
    scheduled: list[str] = engine.scheduler.scheduled  # type: ignore[attr-defined]
    run = engine.dispatch("a", trigger({}), schedule=False)
    engine.execute(run.id)

    def delivered_again(request: str) -> None:
        before = engine.get_run(run.id)
        assert before.status is RunStatus.FAILED
        del scheduled[:]
        caplog.clear()
        with caplog.at_level("INFO", logger="agentruns"):
            again = engine.retry(run.id, request_id=request)
        assert again.status is RunStatus.FAILED and again.error is not None
        assert engine.get_run(run.id) == before  # not queued again, nor touched
        assert scheduled == []
        said = f"retry {request[:200]} was answered already (the run is failed now): not again"
        assert [r.levelname for r in caplog.records if said in r.getMessage()] == ["WARNING"]

    long_one = "m" * 300 + "\x00"  # kept hashed: longer than the column, and a NUL
    for request in ("m1", long_one):
        assert engine.retry(run.id, request_id=request).status is RunStatus.QUEUED
        assert engine.retry(run.id, request_id=request).status is RunStatus.QUEUED  # a nudge
        assert scheduled[-2:] == [run.id, run.id]
        assert engine.execute(run.id).status is RunStatus.FAILED
        delivered_again(request)
    # A request that found the run queued by another (and nudged it), or running (and
    # was refused), was answered too: delivered again once the run failed, nothing.
    assert engine.retry(run.id, request_id="first").status is RunStatus.QUEUED
    assert engine.retry(run.id, request_id="nudged").status is RunStatus.QUEUED
    claimed = engine.store.claim(run.id, "elsewhere:1", utcnow() + timedelta(seconds=30))
    assert claimed is not None
    with pytest.raises(NotRetryableError, match="is running"):
        engine.retry(run.id, request_id="refused")
    error = RunError(code="model_error", message="overloaded")
    failing = Commit(status=RunStatus.FAILED, error=error, release_claim=True)
    engine.store.commit(claimed.run, Guard(status=RunStatus.RUNNING, epoch=claimed.epoch), failing)
    for request in ("nudged", "refused", "first"):
        delivered_again(request)
    assert calls == ["broken"] * 3
    # A request of its own retries it; so does a caller that names none.
    assert engine.retry(run.id, request_id="m2").status is RunStatus.QUEUED
    assert engine.execute(run.id).status is RunStatus.FAILED
    assert engine.retry(run.id).status is RunStatus.QUEUED
    with pytest.raises(TypeError, match="request_id must be text"):
        engine.retry(run.id, request_id=5)  # type: ignore[arg-type]


def test_a_retry_waiting_on_the_run_while_its_request_is_answered_is_undone(
    make_engine: EngineFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # A first try of the request queued the run, and it failed again, while a second
    # try's statement waited on the run's row: that one's snapshot did not see the
    # request, and it failed on the request's key (an IntegrityError) instead of
    # saying it was answered.
    engine = make_engine([Agent("a", ScriptedModel([text("ok")]))], scheduler=ManualScheduler())
    run = engine.dispatch("a", trigger({}), schedule=False)
    claimed = engine.store.claim(run.id, "elsewhere:1", utcnow() + timedelta(seconds=30))
    assert claimed is not None
    failing = Commit(status=RunStatus.FAILED, error=RunError(code="x", message="y"))
    engine.store.commit(claimed.run, Guard(status=RunStatus.RUNNING, epoch=claimed.epoch), failing)
    runs, retries = schema.runs, schema.retries
    first_try = engine.store.engine.connect()  # type: ignore[attr-defined]
    first_try.execute(sa.text("BEGIN"))
    first_try.execute(runs.update().where(runs.c.id == run.id).values(status="queued"))
    first_try.execute(retries.insert().values(run_id=run.id, request_id="m1", at=utcnow()))
    first_try.execute(runs.update().where(runs.c.id == run.id).values(status="failed"))
    outcome: list[Any] = []
    second_try = threading.Thread(
        target=lambda: outcome.append(engine.retry(run.id, request_id="m1"))
    )
    with caplog.at_level("INFO", logger="agentruns"):
        second_try.start()
        time.sleep(0.5)  # its update waits on the run's row
        first_try.execute(sa.text("COMMIT"))
        second_try.join(10)
    first_try.close()
    assert [r.status for r in outcome] == [RunStatus.FAILED]
    assert engine.get_run(run.id).status is RunStatus.FAILED
    assert "retry m1 was answered already (the run is failed now)" in caplog.text


def test_recover_forgets_retry_requests_a_week_old(make_any_engine: EngineFactory) -> None:
    engine = make_any_engine([], scheduler=ManualScheduler())
    retries = schema.retries
    now = utcnow()
    with engine.store.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(
            retries.insert(),
            [
                {"run_id": "r1", "request_id": "old", "at": now - timedelta(days=8)},
                {"run_id": "r1", "request_id": "new", "at": now - timedelta(days=6)},
                {"run_id": "r1", "request_id": "older", "at": now - timedelta(days=9)},
            ],
        )
    # One a week old is forgotten, though its row is still there.
    assert engine.store.note_retry("r1", "older")
    engine.recover()
    with engine.store.engine.connect() as conn:  # type: ignore[attr-defined]
        left = {row.request_id for row in conn.execute(sa.select(retries.c.request_id))}
    assert left == {"new", "older"}
    assert not engine.store.note_retry("r1", "new")


def test_a_run_retried_as_it_fails_goes_on_at_once(make_any_engine: EngineFactory) -> None:
    # A listener that retried a run as soon as it failed (a provider's brief outage)
    # scheduled an execution that found the failing execution's lease still held: the
    # run sat queued until recover took it for a lost message (a minute).
    model = _DownOnce([text("done")], turn=0)
    engine = make_any_engine([Agent("a", model)])
    retried: list[str] = []

    def on_failure(event: Any) -> None:
        if event.run.status is RunStatus.FAILED and not retried:
            retried.append(event.run.id)
            model.down.clear()
            engine.retry(event.run.id)

    engine.on("run.updated", on_failure)
    run = engine.dispatch("a", trigger({}))
    assert engine.idle(10)
    assert retried == [run.id]
    assert engine.get_run(run.id).status is RunStatus.COMPLETED


def test_an_effect_that_raised_fatal_tool_error_is_called_again_by_a_retry(
    make_any_engine: EngineFactory,
) -> None:
    # Its intent stayed without a result: a retry took its outcome for unknown, and
    # with on_unknown="fail" failed again at once, every time.
    calls: list[str] = []
    down = threading.Event()
    down.set()

    @tool(effect=True, on_unknown="fail")
    def pay(cents: int) -> str:
        """Pay."""
        calls.append("pay")
        if down.is_set():
            raise FatalToolError("the payment service is down")
        return f"paid {cents}"

    model = ScriptedModel([tool_use("pay", {"cents": 5}), text("done")])
    engine = make_any_engine([Agent("a", model, tools=[pay])], scheduler=ManualScheduler())
    run = engine.dispatch("a", trigger({}), schedule=False)
    failed = engine.execute(run.id)
    assert failed.error is not None and failed.error.code == "fatal_tool_error"
    assert engine.store.effects(run.id) == {}
    down.clear()
    engine.retry(run.id)
    assert engine.execute(run.id).status is RunStatus.COMPLETED
    assert calls == ["pay", "pay"]
    (record,) = engine.store.effects(run.id).values()
    assert record.done and record.result == "paid 5"


def _thread_of_three(make: EngineFactory) -> tuple[Engine, threading.Event, Run, Run]:
    """An engine whose model is down for a thread's second run, up again now (``down``,
    cleared), and the thread's second run, failed for it, and third, queued behind
    it (its first completed)."""
    down = threading.Event()
    down.set()
    engine = make([Agent("a", _Flaky(down))], scheduler=ManualScheduler())
    runs = [
        engine.dispatch("a", trigger({"say": word}), thread="t", schedule=False)
        for word in ("first", "second", "third")
    ]
    assert engine.execute(runs[0].id).status is RunStatus.COMPLETED
    assert engine.execute(runs[1].id).status is RunStatus.FAILED
    down.clear()
    return engine, down, runs[1], runs[2]


class _Flaky(ScriptedModel):
    """Fails a run whose last message says "second" while ``down`` is set."""

    def __init__(self, down: threading.Event) -> None:
        super().__init__([text("ok")])
        self.down = down

    def complete(self, request: ModelRequest, signal: threading.Event) -> ModelResponse:
        if self.down.is_set() and "second" in str(request.messages[-1]):
            raise ModelError("overloaded")
        return super().complete(request, signal)


def test_a_run_of_a_thread_is_retried_only_while_no_later_run_of_it_has_started(
    make_any_engine: EngineFactory,
) -> None:
    # A later run of the thread went on from the runs before the failed one: the failed
    # one completing afterwards would make the thread's next run skip the later one.
    engine, down, second, third = _thread_of_three(make_any_engine)
    # The third is queued and has not started: the second may go first.
    assert engine.retry(second.id).status is RunStatus.QUEUED
    assert engine.execute(third.id).status is RunStatus.QUEUED  # behind the second
    assert engine.execute(second.id).status is RunStatus.COMPLETED
    assert engine.execute(third.id).status is RunStatus.COMPLETED
    said = [str(m["content"]) for m in engine.checkpoint(third.id).messages]  # type: ignore[union-attr]
    assert [w for w in ("first", "second", "third") if any(w in m for m in said)] == [
        "first",
        "second",
        "third",
    ]
    # Failed again, with a later run of the thread started since: refused.
    down.set()
    fourth = engine.dispatch("a", trigger({"say": "second again"}), thread="t", schedule=False)
    fifth = engine.dispatch("a", trigger({"say": "fifth"}), thread="t", schedule=False)
    assert engine.execute(fourth.id).status is RunStatus.FAILED
    assert engine.execute(fifth.id).status is RunStatus.COMPLETED
    with pytest.raises(NotRetryableError, match=f"run {fifth.id} of its thread 't' has started"):
        engine.retry(fourth.id)
    assert engine.get_run(fourth.id).status is RunStatus.FAILED


def test_a_run_of_a_thread_stored_late_that_started_after_it_holds_its_retry_back(
    make_any_engine: EngineFactory,
) -> None:
    # A run whose write waited on a lock is created before a run stored after it, and
    # starts after it: the failed run's retry was let through, and the thread forked
    # (the next run's history skipped the late run).
    engine, _, second, third = _thread_of_three(make_any_engine)
    with engine.store.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(
            schema.runs.update()
            .where(schema.runs.c.id == third.id)
            .values(created_at=second.created_at - timedelta(seconds=1))
        )
    assert engine.execute(third.id).status is RunStatus.COMPLETED
    with pytest.raises(NotRetryableError, match=f"run {third.id} of its thread 't' has started"):
        engine.retry(second.id)


def test_a_retry_that_raced_a_later_run_of_its_thread_does_not_fork_the_thread(
    make_any_engine: EngineFactory,
) -> None:
    # A retry and the claim of a later run of the thread, at one moment on Postgres,
    # each judged the other's row as it stood before: both went on. The later run
    # continued from the thread's runs before the retried one, which completed after
    # it, and the thread's next run continued from the retried one, skipping the later.
    engine, _, second, third = _thread_of_three(make_any_engine)
    assert engine.execute(third.id).status is RunStatus.COMPLETED  # went on without it
    # What the racing retry committed, its check passed before the claim did:
    with engine.store.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(
            schema.runs.update()
            .where(schema.runs.c.id == second.id)
            .values(status="queued", error=None, finished_at=None)
        )
    refused = engine.execute(second.id)
    assert refused.status is RunStatus.FAILED and refused.error is not None
    assert refused.error.code == "invalid_checkpoint"
    assert f"run {third.id} of its thread 't' started while this one was retried" in (
        refused.error.message
    )
    fourth = engine.dispatch("a", trigger({"say": "fourth"}), thread="t", schedule=False)
    assert engine.execute(fourth.id).status is RunStatus.COMPLETED
    said = " ".join(str(m["content"]) for m in engine.checkpoint(fourth.id).messages)  # type: ignore[union-attr]
    assert "first" in said and "third" in said and "second" not in said


def test_a_later_run_of_the_thread_cancelled_before_it_started_does_not_hold_a_retry_back(
    make_any_engine: EngineFactory,
) -> None:
    engine, _, second, third = _thread_of_three(make_any_engine)
    assert engine.cancel(third.id).status is RunStatus.CANCELLED  # never started
    assert engine.retry(second.id).status is RunStatus.QUEUED
    assert engine.execute(second.id).status is RunStatus.COMPLETED


def test_retry_of_an_unknown_run_is_not_found(make_any_engine: EngineFactory) -> None:
    engine = make_any_engine([Agent("a", ScriptedModel([text("ok")]))])
    with pytest.raises(RunNotFoundError):
        engine.retry("no-such-run")


def test_a_refusal_pickles_whole() -> None:
    # Celery pickles a task's error: one that did not (two arguments, one kept) was
    # shown as its base class, AgentrunsError.
    refused = pickle.loads(pickle.dumps(NotRetryableError("r1", "run r1 is completed")))
    assert type(refused) is NotRetryableError
    assert (refused.run_id, str(refused)) == ("r1", "run r1 is completed")


def _looping(steps: int) -> ScriptedModel:
    """A model that calls ``look`` at each of ``steps`` steps, then answers."""
    return ScriptedModel(
        [*(tool_use("look", {"what": f"w{i}"}) for i in range(steps)), text("done")]
    )


def test_a_run_failed_on_its_own_budget_goes_on_when_a_retry_raises_it(
    make_any_engine: EngineFactory,
) -> None:
    # A run dispatched with a budget of its own that failed on it could not be taken
    # on: a retry failed it again at once, and no API raised a stored budget.
    calls: list[str] = []
    look, _ = _made(calls)
    engine = make_any_engine([Agent("a", _looping(3), tools=[look])], scheduler=ManualScheduler())
    run = engine.dispatch(
        "a", trigger({}), schedule=False, budget={"max_steps": 2, "timeout_s": 60}
    )
    failed = engine.execute(run.id)
    assert failed.error is not None and failed.error.code == "step_budget_exceeded"
    engine.retry(run.id)
    again = engine.execute(run.id)
    assert again.error is not None and again.error.code == "step_budget_exceeded"  # as it was

    retried = engine.retry(run.id, budget={"max_steps": 4})
    assert retried.budget == Budget(max_steps=4, timeout_s=60)  # the limits it names replaced
    done = engine.execute(run.id)
    assert done.status is RunStatus.COMPLETED and done.output == "done"
    assert calls == ["look:w0", "look:w1", "look:w2"]  # none made twice
    assert done.steps_used == 4


def test_a_retrys_budget_replaces_limits_of_the_agents_budget_for_a_run_without_its_own(
    make_any_engine: EngineFactory,
) -> None:
    calls: list[str] = []
    look, _ = _made(calls)
    agent = Agent("a", _looping(2), tools=[look], budget=Budget(max_steps=1, max_tokens=10_000))
    engine = make_any_engine([agent], scheduler=ManualScheduler())
    run = engine.dispatch("a", trigger({}), schedule=False)
    assert engine.execute(run.id).status is RunStatus.FAILED
    engine.retry(run.id, budget=Budget(max_steps=2))
    assert engine.execute(run.id).steps_used == 2
    # A retry's limit below the run's use: it said "used all 1 model steps" of 2.
    engine.retry(run.id, budget=Budget(max_steps=1))
    failed = engine.execute(run.id)
    assert failed.error is not None and failed.error.message == (
        "the run used 2 model steps, over its 1 (a retry's budget below its use)"
    )
    retried = engine.retry(run.id, budget=Budget(max_steps=3))
    assert retried.budget == Budget(max_steps=3, max_tokens=10_000)
    assert engine.execute(run.id).status is RunStatus.COMPLETED


def test_a_retry_with_a_budget_refused_changes_nothing(make_any_engine: EngineFactory) -> None:
    calls: list[str] = []
    look, _ = _made(calls)
    engine = make_any_engine(
        [Agent("a", _looping(2), tools=[look], budget=Budget(max_steps=1))],
        scheduler=ManualScheduler(),
    )
    run = engine.dispatch("a", trigger({}), schedule=False)
    failed = engine.execute(run.id)
    for bad in ({"max_steps": 0}, {"max_steps": "many"}, {"timeout_s": float("inf")}):
        with pytest.raises(InvalidTriggerError, match="invalid budget"):
            engine.retry(run.id, budget=bad)
    # pydantic took True for 1: `--budget '{"max_steps": true}'` was a budget of one step.
    with pytest.raises(InvalidTriggerError, match="max_steps: a limit is a number, not true"):
        engine.retry(run.id, budget={"max_steps": True})
    assert engine.get_run(run.id) == failed
    assert engine.scheduler.scheduled == []  # type: ignore[attr-defined]
    # Queued already by another retry: this one's budget would not be applied, and
    # its caller was told the run was retried (two `agentruns retry --budget` at once).
    engine.retry(run.id)
    with pytest.raises(NotRetryableError, match=r"queued already .* with budget its agent's, not"):
        engine.retry(run.id, budget={"max_steps": 9})
    assert engine.get_run(run.id).budget is None
    # An engine that does not know the run's agent cannot tell what to raise.
    stranger = make_any_engine([], scheduler=ManualScheduler())
    with pytest.raises(UnknownAgentError):
        stranger.retry(run.id, budget={"max_steps": 9})


def test_a_retry_with_a_budget_whose_reply_was_lost_is_sent_again(
    make_any_engine: EngineFactory,
) -> None:
    # The task retried through an outage after a first try that went through: the
    # run is queued with the very budget this retry gives it, and is nudged.
    engine = make_any_engine(
        [Agent("a", _looping(2), tools=[_made([])[0]], budget=Budget(max_steps=1))],
        scheduler=ManualScheduler(),
    )
    run = engine.dispatch("a", trigger({}), schedule=False)
    engine.execute(run.id)
    for _ in range(2):
        assert engine.retry(run.id, budget={"max_steps": 3}).budget == Budget(max_steps=3)
    assert engine.scheduler.scheduled == [run.id, run.id]  # type: ignore[attr-defined]
    assert engine.execute(run.id).status is RunStatus.COMPLETED
