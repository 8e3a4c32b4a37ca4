"""``Engine.retry`` and ``agentruns retry``: a failed run goes on from its latest
checkpoint, its saved work and its effects not repeated."""

from __future__ import annotations

import pickle
import threading
from typing import Any

import pytest

from agentruns import Agent, FatalToolError, RunNotFoundError, RunStatus, tool
from agentruns.errors import NotRetryableError
from agentruns.models import ScriptedModel, text, tool_use
from agentruns.models.base import ModelError, ModelRequest, ModelResponse
from agentruns.schedulers import ManualScheduler
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
    make_any_engine: EngineFactory,
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

    retried = engine.retry(run.id)
    assert retried.status is RunStatus.QUEUED and retried.error is None
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


def test_only_a_failed_run_is_retried_and_only_once(make_any_engine: EngineFactory) -> None:
    engine = make_any_engine([Agent("a", ScriptedModel([text("ok")]))], scheduler=ManualScheduler())
    done = engine.dispatch("a", trigger({"n": 1}), schedule=False)
    engine.execute(done.id)
    with pytest.raises(NotRetryableError, match="is completed: only a failed run is retried"):
        engine.retry(done.id)
    assert engine.get_run(done.id).status is RunStatus.COMPLETED
    failed = engine.dispatch("a", trigger({"n": 2}), schedule=False)
    failed = engine.store.retry(failed.id)[0]  # queued: refused
    assert failed.status is RunStatus.QUEUED
    with pytest.raises(NotRetryableError, match="is queued"):
        engine.retry(failed.id)


def test_two_retries_at_once_queue_the_run_once(make_engine: EngineFactory) -> None:
    def broken() -> str:
        raise FatalToolError("no")

    agent = Agent("a", ScriptedModel([tool_use("broken", {}), text("ok")]), tools=[tool(broken)])
    engine = make_engine([agent], scheduler=ManualScheduler())
    run = engine.dispatch("a", trigger({}), schedule=False)
    assert engine.execute(run.id).status is RunStatus.FAILED
    outcomes: list[str] = []
    barrier = threading.Barrier(4)

    def retry() -> None:
        barrier.wait()
        try:
            engine.retry(run.id)
            outcomes.append("retried")
        except NotRetryableError:
            outcomes.append("refused")

    threads = [threading.Thread(target=retry) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["refused"] * 3 + ["retried"]
    assert engine.scheduler.scheduled == [run.id]  # type: ignore[attr-defined]


def test_a_run_of_a_thread_is_retried_only_while_no_later_run_of_it_has_started(
    make_any_engine: EngineFactory,
) -> None:
    # A later run of the thread went on from the runs before the failed one: the failed
    # one completing afterwards would make the thread's next run skip the later one.
    down = threading.Event()
    down.set()

    class Flaky(ScriptedModel):
        def complete(self, request: ModelRequest, signal: threading.Event) -> ModelResponse:
            if down.is_set() and "second" in str(request.messages[-1]):
                raise ModelError("overloaded")
            return super().complete(request, signal)

    engine = make_any_engine([Agent("a", Flaky([text("ok")]))], scheduler=ManualScheduler())
    runs = [
        engine.dispatch("a", trigger({"say": word}), thread="t", schedule=False)
        for word in ("first", "second", "third")
    ]
    first, second, third = runs
    assert engine.execute(first.id).status is RunStatus.COMPLETED
    assert engine.execute(second.id).status is RunStatus.FAILED
    down.clear()
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
