"""Approvals: waiting runs and signed, expiring, single-use resume tokens."""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from agentruns import (
    Agent,
    Engine,
    InvalidTokenError,
    Run,
    RunStatus,
    ToolContext,
    UnknownAgentError,
    WaitPoint,
    tokens,
    tool,
)
from agentruns.announcer import Announcer
from agentruns.errors import NotifierError
from agentruns.events import Event
from agentruns.models import ScriptedModel, text, tool_use
from agentruns.schedulers import ManualScheduler
from tests.conftest import EngineFactory, Errors, trigger, wait_for


class Calls(list[tuple[str, dict[str, Any]]]):
    def names(self) -> list[str]:
        return [name for name, _ in self]


@pytest.fixture
def calls() -> Calls:
    return Calls()


def tracker_tools(calls: Calls) -> list[Any]:
    @tool(effect=True, needs_approval=True)
    def post_comment(issue: str, body: str, ctx: ToolContext) -> dict[str, Any]:
        """Post a comment."""
        calls.append(("post_comment", {"issue": issue, "body": body}))
        return {"posted": True}

    @tool(needs_approval=lambda args, ctx: args["label"] == "wontfix")
    def label(issue: str, label: str) -> str:
        """Label an issue; wontfix needs a human."""
        calls.append(("label", {"issue": issue, "label": label}))
        return "labelled"

    @tool
    def search(query: str) -> list[str]:
        """Search."""
        calls.append(("search", {"query": query}))
        return ["#1"]

    return [post_comment, label, search]


def comment_agent(calls: Calls, **kwargs: Any) -> tuple[Agent, ScriptedModel]:
    model = ScriptedModel(
        [tool_use("post_comment", {"issue": "7", "body": "Duplicate of #1"}), text("Done.")]
    )
    return Agent("triage", model, tools=tracker_tools(calls), **kwargs), model


def wait_until_waiting(engine: Engine, run_id: str) -> Run:
    assert engine.idle(10)
    run = engine.get_run(run_id)
    assert run.status is RunStatus.WAITING, run
    return run


def test_approve_runs_the_tool_once_and_completes(make_engine: EngineFactory, calls: Calls) -> None:
    agent, model = comment_agent(calls)
    engine = make_engine([agent])
    run = engine.dispatch("triage", trigger({"issue": 7}))
    run = wait_until_waiting(engine, run.id)
    assert run.claim is None and calls == []
    wait = run.waiting
    assert wait is not None and wait.tool_name == "post_comment"
    assert wait.input == {"issue": "7", "body": "Duplicate of #1"}

    resumed = engine.resume(engine.approval_token(run.id), approved=True, reason="fine")
    assert resumed.status is RunStatus.QUEUED and resumed.waiting is None
    assert engine.idle(10)
    done = engine.get_run(run.id)
    assert done.status is RunStatus.COMPLETED
    assert calls.names() == ["post_comment"]
    assert len(model.calls) == 2
    kinds = [(s.kind, s.name) for s in engine.steps(run.id)]
    assert kinds == [
        ("llm", "scripted"),
        ("wait", "post_comment"),
        ("tool", "post_comment"),
        ("llm", "scripted"),
    ]
    wait_step = engine.steps(run.id)[1]
    assert wait_step.output == {"approval_id": wait.approval_id, "approved": True, "reason": "fine"}


def test_deny_reaches_the_model_with_the_reason_and_never_runs_the_tool(
    make_engine: EngineFactory, calls: Calls
) -> None:
    agent, model = comment_agent(calls)
    engine = make_engine([agent])
    run = wait_until_waiting(engine, engine.dispatch("triage", trigger({})).id)
    engine.resume(engine.approval_token(run.id), approved=False, reason="too rude")
    assert engine.idle(10)
    assert engine.get_run(run.id).status is RunStatus.COMPLETED
    assert calls == []
    result = model.calls[1][-1]["content"][0]
    assert result["is_error"] is True and "too rude" in result["content"]
    # The denial is the call's result: a tool row records it (seed 004, "Steps"),
    # after the wait row that records the answer.
    steps = engine.steps(run.id)
    assert [s.kind for s in steps] == ["llm", "wait", "tool", "llm"]
    assert steps[2].name == "post_comment" and steps[2].input == steps[1].input
    assert steps[2].error == {"code": "approval_denied", "message": result["content"]}


def _tamper(token: str) -> str:
    body, sig = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    claims["r"] = "someone-else"
    forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"{forged}.{sig}"


def _unsigned(body: str) -> str:
    """A token of this body (JSON text) and any signature."""
    return base64.urlsafe_b64encode(body.encode()).rstrip(b"=").decode() + ".AAAA"


def test_bad_tokens_are_refused_with_their_reason_and_change_nothing(
    make_engine: EngineFactory, calls: Calls
) -> None:
    agent, _ = comment_agent(calls)
    engine = make_engine([agent])
    run = wait_until_waiting(engine, engine.dispatch("triage", trigger({})).id)
    token = engine.approval_token(run.id)
    foreign = make_engine([agent], secret="another-secret")
    before = (engine.get_run(run.id), engine.steps(run.id))

    cases = {
        "malformed": [
            "",
            "nonsense",
            "a.b.c",
            "!!!.###",
            # Read before the signature is checked: expiries no date can hold, JSON
            # nested deeper than the parser goes. (They escaped as OSError and
            # RecursionError, which a Celery resume task retried forever.)
            *(
                _unsigned(f'{{"r":"x","a":"x","t":"x","e":{e},"h":"x"}}')
                for e in (10**17, -(2**63), 10**400)
            ),
            _unsigned("[" * 100_000 + "]" * 100_000),
        ],
        "bad_signature": [_tamper(token), token[:-2] + ("AA" if token[-2:] != "AA" else "BB")],
    }
    for reason, bad_tokens in cases.items():
        for bad in bad_tokens:
            with pytest.raises(InvalidTokenError) as err:
                engine.resume(bad, approved=True)
            assert err.value.reason == reason, bad
    with pytest.raises(InvalidTokenError) as err:
        foreign.resume(token, approved=True)
    assert err.value.reason == "bad_signature"
    # A good token with answers that are not an answer: "no" is truthy, not a denial.
    for answer in ({"approved": "no"}, {"approved": 1}, {"approved": True, "reason": {1}}):
        with pytest.raises(TypeError):
            engine.resume(token, **answer)
    with pytest.raises(TypeError):
        engine.resume(token, approved=False, reason="\ud800")
    assert (engine.get_run(run.id), engine.steps(run.id)) == before
    assert calls == []

    engine.resume(token, approved=False)
    with pytest.raises(InvalidTokenError) as err:
        engine.resume(token, approved=True)  # reused
    assert err.value.reason == "stale"
    # Its message says the reason too: a worker's log is searched for it.
    assert str(err.value) == "invalid resume token (stale): the run is not waiting on this token"


def test_a_token_with_spaces_or_a_line_end_around_it_is_the_token(
    make_engine: EngineFactory, calls: Calls
) -> None:
    # A bot that pasted the token with its newline was told the token was altered or
    # minted with another secret (bad_signature).
    agent, _ = comment_agent(calls)
    engine = make_engine([agent])
    run = wait_until_waiting(engine, engine.dispatch("triage", trigger({})).id)
    token = engine.approval_token(run.id)
    assert engine.resume(f"  {token}\r\n", approved=True).status is RunStatus.QUEUED
    assert engine.idle(10)
    assert engine.get_run(run.id).status is RunStatus.COMPLETED
    assert calls.names() == ["post_comment"]
    with pytest.raises(InvalidTokenError) as err:
        engine.resume(f"{token[:10]} {token[10:]}", approved=True)  # inside: no token
    assert err.value.reason == "malformed"


def test_expired_token_is_refused_and_tick_denies_the_expired_wait(
    make_engine: EngineFactory, calls: Calls
) -> None:
    agent, model = comment_agent(calls, approval_ttl=timedelta(seconds=0.5))
    engine = make_engine([agent])
    run = wait_until_waiting(engine, engine.dispatch("triage", trigger({})).id)
    token = engine.approval_token(run.id)
    time.sleep(1.1)
    with pytest.raises(InvalidTokenError) as err:
        engine.resume(token, approved=True)
    assert err.value.reason == "expired"
    assert engine.get_run(run.id).status is RunStatus.WAITING

    engine.tick()
    assert engine.idle(10)
    assert engine.get_run(run.id).status is RunStatus.COMPLETED
    assert calls == []
    assert "approval expired" in model.calls[1][-1]["content"][0]["content"]
    wait_steps = [s for s in engine.steps(run.id) if s.kind == "wait"]
    assert wait_steps[0].output["reason"] == "approval expired"
    engine.tick()  # idempotent
    assert len([s for s in engine.steps(run.id) if s.kind == "wait"]) == 1


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ('"text"', "its pending is not a valid object ('text')"),
        ('{"x": "garbage"}', "its pending has an entry for x that is not a valid one ('garbage')"),
    ],
)
@pytest.mark.parametrize("answer", ["resume", "expire"])
def test_a_waiting_run_whose_pending_answers_are_damaged_fails_when_answered(
    make_engine: EngineFactory,
    calls: Calls,
    monkeypatch: pytest.MonkeyPatch,
    answer: str,
    damage: str,
    said: str,
) -> None:
    # resume raised a bare TypeError (not an AgentrunsError), and tick sent it to
    # on_error on every sweep, the run waiting for good.
    agent, _ = comment_agent(calls)
    engine = make_engine([agent])
    run = wait_until_waiting(engine, engine.dispatch("triage", trigger({})).id)
    token = engine.approval_token(run.id)
    with engine.store.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(
            sa.text("UPDATE agentruns_runs SET pending = :value WHERE id = :id"),
            {"value": damage, "id": run.id},
        )
    if answer == "resume":
        failed = engine.resume(token, approved=True)
    else:
        assert run.waiting is not None
        later = run.waiting.expires_at + timedelta(seconds=1)
        monkeypatch.setattr("agentruns.approvals.utcnow", lambda: later)
        engine.tick()
        failed = engine.get_run(run.id)
    assert failed.status is RunStatus.FAILED and failed.waiting is None
    assert failed.error is not None and failed.error.code == "invalid_checkpoint"
    assert said in failed.error.message
    assert engine.get_run(run.id) == failed
    with pytest.raises(InvalidTokenError):
        engine.resume(token, approved=True)
    assert calls == []


def test_a_token_lasts_exactly_as_long_as_its_wait_point(
    make_engine: EngineFactory, calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent, _ = comment_agent(calls, approval_ttl=timedelta(hours=1))
    engine = make_engine([agent])
    run = wait_until_waiting(engine, engine.dispatch("triage", trigger({})).id)
    assert run.waiting is not None
    expires = run.waiting.expires_at
    token = engine.approval_token(run.id)
    # The token holds its expiry in whole seconds: never one before the wait point's.
    just_before = expires - timedelta(microseconds=1)
    assert tokens.verify(engine.secret, token, now=just_before).run_id == run.id
    # Past the wait point's own expiry and before tick has answered it: refused.
    monkeypatch.setattr("agentruns.approvals.utcnow", lambda: expires)
    with pytest.raises(InvalidTokenError) as err:
        engine.resume(token, approved=True)
    assert err.value.reason == "expired"
    assert engine.get_run(run.id).status is RunStatus.WAITING and calls == []
    monkeypatch.undo()
    engine.resume(token, approved=True)
    assert engine.idle(10)
    assert engine.get_run(run.id).status is RunStatus.COMPLETED and len(calls) == 1


def test_an_approval_whose_input_holds_a_nul_can_be_answered_and_expired(
    make_engine: EngineFactory, calls: Calls, errors: Errors
) -> None:
    # JSON keeps "\u0000", but Postgres cannot read such a document as text: the
    # resume's guard and tick's expiry must not depend on that.
    def agent(name: str, body: str, ttl: float) -> Agent:
        model = ScriptedModel(
            [tool_use("post_comment", {"issue": "7", "body": body}), text("Done.")]
        )
        return Agent(name, model, tools=tracker_tools(calls), approval_ttl=timedelta(seconds=ttl))

    agents = [agent("answered", "a\x00b", 60), agent("nul", "a\x00b", 1), agent("plain", "ab", 1)]
    engine = make_engine(agents)
    answered = wait_until_waiting(engine, engine.dispatch("answered", trigger({})).id)
    engine.resume(engine.approval_token(answered.id), approved=True)
    assert engine.idle(10)
    assert engine.get_run(answered.id).status is RunStatus.COMPLETED
    assert calls == [("post_comment", {"issue": "7", "body": "a\x00b"})]

    runs = [
        wait_until_waiting(engine, engine.dispatch(a, trigger({})).id) for a in ("nul", "plain")
    ]
    time.sleep(1.1)
    engine.tick()
    assert engine.idle(10)
    assert [engine.get_run(r.id).status for r in runs] == [RunStatus.COMPLETED] * 2
    assert len(calls) == 1 and errors == []


def test_tick_goes_on_past_a_waiting_run_it_cannot_read(
    make_engine: EngineFactory, calls: Calls
) -> None:
    agent, _ = comment_agent(calls, approval_ttl=timedelta(seconds=0.5))
    engine = make_engine([agent])
    damaged, fine = [
        wait_until_waiting(engine, engine.dispatch("triage", trigger({})).id) for _ in "ab"
    ]
    with engine.store.engine.begin() as conn:  # damaged outside agentruns
        conn.execute(
            sa.text(
                'UPDATE agentruns_runs SET waiting = \'{"not": "a wait point"}\' WHERE id = :id'
            ),
            {"id": damaged.id},
        )
    time.sleep(1.1)
    engine.tick()
    assert engine.idle(10)
    assert engine.get_run(fine.id).status is RunStatus.COMPLETED


def test_tick_goes_on_past_a_run_it_cannot_answer(
    make_engine: EngineFactory, calls: Calls, errors: Errors, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent, _ = comment_agent(calls, approval_ttl=timedelta(seconds=0.5))
    engine = make_engine([agent])
    runs = [wait_until_waiting(engine, engine.dispatch("triage", trigger({})).id) for _ in "ab"]
    time.sleep(1.1)
    answer = engine._approvals._answer

    def broken_for_the_first(run: Run, **kwargs: Any) -> Run:
        if run.id == runs[0].id:
            raise RuntimeError("this one is broken")
        return answer(run, **kwargs)

    monkeypatch.setattr(engine._approvals, "_answer", broken_for_the_first)
    engine.tick()
    assert engine.idle(10)
    statuses = [engine.get_run(r.id).status for r in runs]
    assert statuses == [RunStatus.WAITING, RunStatus.COMPLETED]
    assert [str(e) for e in errors] == ["this one is broken"]


def test_tick_reads_no_waiting_run_it_has_nothing_to_do_for(
    make_any_engine: EngineFactory, calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every tick (every 5 s) read and parsed every waiting run's wait point, the
    # tool's input with it: 3000 waiting runs of 100 KB took 0.6 s and 600 MB each.
    notified: list[str] = []
    announced, _ = comment_agent(calls, notifier=lambda run, wait, token: notified.append(run.id))
    model = ScriptedModel([tool_use("post_comment", {"issue": "7", "body": "x"}), text("Done.")])
    quiet = Agent("quiet", model, tools=tracker_tools(calls))  # no notifier: nothing to re-send
    engine = make_any_engine([announced, quiet])
    runs = [
        wait_until_waiting(engine, engine.dispatch(name, trigger({})).id)
        for name in ("triage", "quiet")
    ]
    assert notified == [runs[0].id]
    read: list[object] = []
    validate, get_run, get_runs = (
        WaitPoint.model_validate,
        engine.store.get_run,
        engine.store.get_runs,
    )

    def validating(value: object, **kwargs: Any) -> WaitPoint:
        read.append(value)
        return validate(value, **kwargs)

    def getting(run_id: str) -> Run:
        read.append(run_id)
        return get_run(run_id)

    monkeypatch.setattr(WaitPoint, "model_validate", staticmethod(validating))

    def getting_several(run_ids: list[str]) -> list[Run]:
        read.extend(run_ids)
        return get_runs(run_ids)

    monkeypatch.setattr(engine.store, "get_run", getting)
    monkeypatch.setattr(engine.store, "get_runs", getting_several)
    engine.tick()  # the first of this engine's reads what it meets, once
    assert sorted(r for r in read if isinstance(r, str)) == sorted(r.id for r in runs)
    read.clear()
    engine.tick()
    assert read == []
    # Past their expiry, both are read, and denied.
    last = runs[1].waiting
    assert last is not None
    monkeypatch.setattr("agentruns.approvals.utcnow", lambda: last.expires_at)
    engine.tick()
    assert len(read) >= 2
    assert engine.idle(10)
    assert [engine.get_run(r.id).status for r in runs] == [RunStatus.COMPLETED] * 2
    assert calls == [] and notified == [runs[0].id]


def test_an_engine_without_the_runs_agent_refuses_to_answer_and_changes_nothing(
    make_engine: EngineFactory, calls: Calls
) -> None:
    agent, _ = comment_agent(calls)
    engine = make_engine([agent])
    other = make_engine([Agent("someone-else", ScriptedModel([text("hi")]))])
    run = wait_until_waiting(engine, engine.dispatch("triage", trigger({})).id)
    token = engine.approval_token(run.id)
    with pytest.raises(UnknownAgentError, match="triage"):
        other.resume(token, approved=True)
    assert other.get_run(run.id).status is RunStatus.WAITING
    engine.resume(token, approved=True)  # the token is still good where the agent is
    assert engine.idle(10)
    assert engine.get_run(run.id).status is RunStatus.COMPLETED
    assert calls.names() == ["post_comment"]


def test_idle_waits_for_an_execute_called_directly_until_its_notifier_returns(
    make_engine: EngineFactory, calls: Calls
) -> None:
    called = threading.Event()
    go_on = threading.Event()

    def notifier(run: Run, wait: WaitPoint, token: str) -> None:
        called.set()
        go_on.wait(10)

    agent, _ = comment_agent(calls, notifier=notifier)
    engine = make_engine([agent], scheduler=ManualScheduler())
    run = engine.dispatch("triage", trigger({}))
    executing = threading.Thread(target=engine.execute, args=(run.id,))
    executing.start()
    assert called.wait(10)  # the run's lease is let go: only the notifier is left
    assert not engine.idle(0.2)
    go_on.set()
    assert engine.idle(10)
    waiting = engine.get_run(run.id)
    assert waiting.waiting is not None and waiting.waiting.notified_at is not None
    executing.join(5)


def assert_in_commit_order(seen: list[Run]) -> None:
    """A listener's run.updated events of an answered run, as they happened: the
    pause, then the answer's requeue, then the rest, ending completed."""
    statuses = [r.status.value for r in seen]
    assert statuses[-1] == "completed", statuses
    assert statuses[statuses.index("waiting") + 1] == "queued", statuses
    assert [r.updated_at for r in seen] == sorted(r.updated_at for r in seen), statuses


def test_a_listener_that_answers_leaves_the_next_listeners_events_in_order(
    make_engine: EngineFactory, calls: Calls
) -> None:
    agent, _ = comment_agent(calls)
    engine = make_engine([agent])

    def approve(event: Event) -> None:
        if event.run is not None and event.run.status is RunStatus.WAITING:
            engine.resume(engine.approval_token(event.run.id), approved=True)

    seen: list[Run] = []
    engine.on("run.updated", approve)
    engine.on("run.updated", lambda event: seen.append(event.run) if event.run else None)
    run = engine.dispatch("triage", trigger({}))
    assert engine.idle(10)
    assert engine.get_run(run.id).status is RunStatus.COMPLETED
    assert [r.status for r in seen].count(RunStatus.WAITING) == 1
    assert_in_commit_order(seen)


def test_a_runs_events_keep_their_commit_order_when_another_thread_answers(
    make_engine: EngineFactory, calls: Calls
) -> None:
    # The answer (a web handler's thread) committed "queued", then its listeners took
    # a while; the execution the pausing engine scheduled meanwhile delivered its
    # "running" and "completed" first, and every listener ended on "queued".
    agent, _ = comment_agent(calls)
    engine = make_engine([agent])
    answered = threading.Event()

    def answer(run_id: str) -> None:
        engine.resume(engine.approval_token(run_id), approved=True)

    def on_run(event: Event) -> None:
        assert event.run is not None
        seen.append(event.run)
        if event.run.status is RunStatus.WAITING and not answered.is_set():
            answered.set()
            threading.Thread(target=answer, args=(event.run.id,)).start()
            # The answer commits before this engine looks at the run again.
            wait_for(lambda: engine.get_run(event.run.id).status is not RunStatus.WAITING)

    def on_step(event: Event) -> None:
        if event.step is not None and event.step.kind == "wait":
            time.sleep(0.5)  # shipping the answer to an audit log

    seen: list[Run] = []
    engine.on("run.updated", on_run)
    engine.on("step.appended", on_step)
    run = engine.dispatch("triage", trigger({}))
    assert engine.idle(10)
    assert engine.get_run(run.id).status is RunStatus.COMPLETED
    assert_in_commit_order(seen)


def test_idle_waits_for_another_threads_answer_and_the_execution_it_starts(
    make_engine: EngineFactory, calls: Calls
) -> None:
    # idle() said True while the answer's listeners ran, before it scheduled the run.
    agent, _ = comment_agent(calls)
    engine = make_engine([agent])
    run = wait_until_waiting(engine, engine.dispatch("triage", trigger({})).id)
    token = engine.approval_token(run.id)

    def slow(event: Event) -> None:
        if event.run is not None and event.run.status is RunStatus.QUEUED:
            time.sleep(0.5)

    engine.on("run.updated", slow)
    answering = threading.Thread(target=engine.resume, args=(token,), kwargs={"approved": True})
    answering.start()
    wait_for(lambda: engine.get_run(run.id).status is RunStatus.QUEUED)
    assert engine.idle(10)
    assert engine.get_run(run.id).status is RunStatus.COMPLETED
    answering.join(5)


def test_close_waits_for_a_tick_in_progress_and_idle_counts_it(
    make_engine: EngineFactory, calls: Calls
) -> None:
    # A tick denying an expired approval (its listeners running) was no call in
    # progress: idle() said True, and close() closed the engine under it, whose
    # scheduling of the answered run was then dropped without a word.
    agent, _ = comment_agent(calls, approval_ttl=timedelta(seconds=0.3))
    engine = make_engine([agent])
    run = wait_until_waiting(engine, engine.dispatch("triage", trigger({})).id)
    time.sleep(0.4)
    in_listener = threading.Event()

    def slow(event: Event) -> None:
        if event.run is not None and event.run.status is RunStatus.QUEUED:
            in_listener.set()
            time.sleep(0.5)  # shipping the denial to an audit log

    engine.on("run.updated", slow)
    ticking = threading.Thread(target=engine.tick)
    ticking.start()
    assert in_listener.wait(10)
    assert not engine.idle(0.1)
    engine.close()
    assert not ticking.is_alive()  # close() waited for it
    assert engine.get_run(run.id).status is RunStatus.QUEUED  # answered: recover's now
    later = make_engine([agent], requeue_after=0.1)
    time.sleep(0.2)
    assert later.recover() == [run.id]
    assert later.idle(10)
    assert later.get_run(run.id).status is RunStatus.COMPLETED


def test_execute_returns_once_the_notifier_of_the_run_it_paused_returned(
    make_engine: EngineFactory, calls: Calls
) -> None:
    # The notifier runs on a thread of the engine's own (a worker's task does not wait
    # for it); execute() called directly still returns after it, as it did.
    delivered: list[str] = []

    def notifier(run: Run, wait: WaitPoint, token: str) -> None:
        time.sleep(0.3)
        delivered.append(token)

    agent, _ = comment_agent(calls, notifier=notifier)
    engine = make_engine([agent], scheduler=ManualScheduler())
    run = engine.dispatch("triage", trigger({}), schedule=False)
    assert engine.execute(run.id).status is RunStatus.WAITING
    assert len(delivered) == 1
    waiting = engine.get_run(run.id).waiting
    assert waiting is not None and waiting.notified_at is not None
    # A worker's task does not wait; idle() does.
    second = engine.dispatch("triage", trigger({"n": 2}), schedule=False)
    assert engine.execute(second.id, wait_for_notifiers=False).status is RunStatus.WAITING
    assert len(delivered) == 1
    assert engine.idle(10) and len(delivered) == 2


def test_close_makes_the_notifier_calls_asked_for_before_it(
    make_engine: EngineFactory, calls: Calls
) -> None:
    # close() dropped a call asked for that no thread had taken yet (about 1 in 300
    # with an engine's 8 threads; here the one thread is busy): it waited for a tick,
    # of whichever engine, to be made.
    delivered: list[str] = []

    def slow_first(run: Run) -> None:
        time.sleep(0.3 if not delivered else 0)
        delivered.append(run.id)

    agent, _ = comment_agent(calls)
    engine = make_engine([agent], scheduler=ManualScheduler())
    runs = [engine.dispatch("triage", trigger({"n": n}), schedule=False) for n in range(2)]
    for run in runs:
        engine.execute(run.id, wait_for_notifiers=False)
    announcer = Announcer(slow_first, engine.report, threads=1)
    for run in runs:
        announcer.ask(engine.get_run(run.id))
    announcer.close(timeout=5)
    assert delivered == [run.id for run in runs]


def test_a_notifier_failing_twice_is_retried_by_tick_and_succeeds_exactly_once(
    make_engine: EngineFactory, calls: Calls, errors: Errors
) -> None:
    attempts: list[str] = []
    delivered: list[tuple[str, WaitPoint, str]] = []

    def notifier(run: Run, wait: WaitPoint, token: str) -> None:
        attempts.append(run.id)
        if len(attempts) <= 2:
            raise ConnectionError("chat is down")
        delivered.append((run.id, wait, token))

    agent, _ = comment_agent(calls, notifier=notifier)
    engine = make_engine([agent])
    other = make_engine([agent])
    run = wait_until_waiting(engine, engine.dispatch("triage", trigger({})).id)
    assert len(attempts) == 1 and engine.get_run(run.id).waiting.notified_at is None  # type: ignore[union-attr]
    # Each tick does its work before it returns (SPEC), on threads of the engine's own.
    for ticking, tried, done in ((engine, 2, 0), (other, 3, 1), (engine, 3, 1), (other, 3, 1)):
        ticking.tick()
        assert (len(attempts), len(delivered)) == (tried, done)
    waiting = engine.get_run(run.id)
    assert waiting.status is RunStatus.WAITING
    assert waiting.waiting is not None and waiting.waiting.notified_at is not None
    # on_error has them, as the notifier's own failures (not the store's or Redis').
    failures = errors.of(NotifierError)
    assert len(failures) == 2 and all(isinstance(e.__cause__, ConnectionError) for e in failures)
    # The token the notifier got works.
    engine.resume(delivered[0][2], approved=True)
    assert engine.idle(10)
    assert engine.get_run(run.id).status is RunStatus.COMPLETED


def test_a_notifier_that_keeps_failing_logs_its_traceback_once_per_run(
    make_engine: EngineFactory, calls: Calls, caplog: pytest.LogCaptureFixture
) -> None:
    # Without on_error, each failure was an ERROR with its traceback, and beat's tick
    # calls the notifier again every 5 s: 17,000 tracebacks a day for one run.
    def notifier(run: Run, wait: WaitPoint, token: str) -> None:
        raise ConnectionError("chat is down")

    agent, _ = comment_agent(calls, notifier=notifier)
    engine = make_engine([agent], on_error=None)
    with caplog.at_level(logging.ERROR, logger="agentruns"):
        runs = [engine.dispatch("triage", trigger({})).id for _ in range(2)]
        for run_id in runs:
            wait_until_waiting(engine, run_id)
        for _ in range(3):
            engine.tick()
    for run_id in runs:
        of_run = [
            r
            for r in caplog.records
            if run_id in r.getMessage() or (r.exc_info and run_id in str(r.exc_info[1]))
        ]
        assert len(of_run) == 4  # the pause's call and three ticks'
        assert [r.exc_info is not None for r in of_run] == [True, False, False, False]
        assert of_run[1].getMessage() == (
            f"agentruns: the notifier of run {run_id} failed: ConnectionError: chat is down (again)"
        )


@pytest.mark.parametrize("notified", [True, False])
def test_tick_cancels_a_run_flagged_as_it_paused_by_a_process_that_died(
    make_engine: EngineFactory, calls: Calls, notified: bool
) -> None:
    """A cancel flagged as the run paused cancels it once it waits (execution.py),
    but the process that paused it died before it did: the run stayed waiting, its
    notifier asked someone to approve it, and an approval ran its tool."""
    attempts: list[str] = []

    def notifier(run: Run, wait: WaitPoint, token: str) -> None:
        attempts.append(run.id)
        if not notified:
            raise ConnectionError("chat is down")

    agent, _ = comment_agent(calls, notifier=notifier)
    engine = make_engine([agent])
    run = wait_until_waiting(engine, engine.dispatch("triage", trigger({})).id)
    token = engine.approval_token(run.id)
    engine.tick()  # it has read the wait point: nothing to do until it expires
    assert len(attempts) == 1 + (not notified)
    # What the dead process left: the run waiting, its cancel flagged.
    with engine.store.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(
            sa.text("UPDATE agentruns_runs SET cancel_requested = true WHERE id = :id"),
            {"id": run.id},
        )
    engine.tick()
    cancelled = engine.get_run(run.id)
    assert cancelled.status is RunStatus.CANCELLED and cancelled.waiting is None
    assert len(attempts) == 1 + (not notified)  # nobody asked again
    with pytest.raises(InvalidTokenError):
        engine.resume(token, approved=True)
    assert calls == []


def test_a_denied_call_still_lets_the_calls_after_it_run_in_order(
    make_engine: EngineFactory, calls: Calls
) -> None:
    model = ScriptedModel(
        [
            [
                tool_use("search", {"query": "before"}),
                tool_use("post_comment", {"issue": "1", "body": "a"}),
                tool_use("search", {"query": "after"}),
            ],
            text("ok"),
        ]
    )
    engine = make_engine([Agent("triage", model, tools=tracker_tools(calls))])
    run = wait_until_waiting(engine, engine.dispatch("triage", trigger({})).id)
    assert calls == [("search", {"query": "before"})]
    engine.resume(engine.approval_token(run.id), approved=False, reason="no")
    assert engine.idle(10)
    assert engine.get_run(run.id).status is RunStatus.COMPLETED
    assert calls == [("search", {"query": "before"}), ("search", {"query": "after"})]
    results = model.calls[1][-1]["content"]
    assert [r.get("is_error", False) for r in results] == [False, True, False]


@pytest.mark.parametrize("answered_by", ["notifier", "listener"])
def test_an_answer_given_while_the_run_pauses_is_not_lost(
    make_engine: EngineFactory, calls: Calls, answered_by: str
) -> None:
    # An auto-approver answers in the notifier, or in a run.updated listener, while
    # the pausing execution still holds the run's lease: the execution the answer
    # schedules finds the lease held; the run must still go on, not stay queued.
    engines: list[Engine] = []

    def approve(run: Run, wait: WaitPoint, token: str) -> None:
        engines[0].resume(token, approved=True)

    def on_update(event: Event) -> None:
        run = event.run
        if run is not None and run.status is RunStatus.WAITING:
            engines[0].resume(engines[0].approval_token(run.id), approved=True)

    agent, model = comment_agent(calls, notifier=approve if answered_by == "notifier" else None)
    engine = make_engine([agent])
    engines.append(engine)
    if answered_by == "listener":
        engine.on("run.updated", on_update)
    run = engine.dispatch("triage", trigger({}))
    wait_for(lambda: engine.get_run(run.id).status.is_final, "the run to finish", timeout=10)
    assert engine.get_run(run.id).status is RunStatus.COMPLETED
    assert calls.names() == ["post_comment"] and len(model.calls) == 2


def test_two_approvals_in_one_step_pause_one_at_a_time_and_the_model_is_called_twice(
    make_engine: EngineFactory, calls: Calls
) -> None:
    model = ScriptedModel(
        [
            [
                tool_use("post_comment", {"issue": "1", "body": "a"}),
                tool_use("search", {"query": "dupes"}),
                tool_use("post_comment", {"issue": "2", "body": "b"}),
            ],
            text("Both handled."),
        ]
    )
    engine = make_engine([Agent("triage", model, tools=tracker_tools(calls))])
    run = wait_until_waiting(engine, engine.dispatch("triage", trigger({})).id)
    assert calls == []  # the calls after one awaiting approval wait for its answer
    first = run.waiting
    assert first is not None and first.input == {"issue": "1", "body": "a"}

    engine.resume(engine.approval_token(run.id), approved=True)
    run = wait_until_waiting(engine, run.id)
    assert calls.names() == ["post_comment", "search"]  # in the model's order
    second = run.waiting
    assert second is not None and second.input == {"issue": "2", "body": "b"}
    assert second.approval_id != first.approval_id
    assert len(model.calls) == 1  # re-paused without asking the model

    engine.resume(engine.approval_token(run.id), approved=False, reason="no")
    assert engine.idle(10)
    assert engine.get_run(run.id).status is RunStatus.COMPLETED
    assert len(model.calls) == 2
    assert calls.names() == ["post_comment", "search"]
    results = model.calls[1][-1]["content"]
    assert [r["tool_use_id"] for r in results] == [b["id"] for b in model.calls[1][-2]["content"]]
    assert [r.get("is_error", False) for r in results] == [False, False, True]
    checkpoint = engine.checkpoint(run.id)
    assert checkpoint is not None and checkpoint.step_index == 1


def test_an_operators_answer_to_an_approval_answered_meanwhile_is_not_taken_for_the_next(
    make_engine: EngineFactory, calls: Calls
) -> None:
    # Two operators looked at a run waiting on the first of two approvals; one approved
    # it, and the other's answer by the run's id answered the second, which nobody had
    # seen. Pinned to the approval looked at, it is refused.
    model = ScriptedModel(
        [
            [
                tool_use("post_comment", {"issue": "1", "body": "a"}),
                tool_use("post_comment", {"issue": "2", "body": "b"}),
            ],
            text("Both handled."),
        ]
    )
    engine = make_engine([Agent("triage", model, tools=tracker_tools(calls))])
    run = wait_until_waiting(engine, engine.dispatch("triage", trigger({})).id)
    assert run.waiting is not None
    seen = run.waiting.approval_id
    engine.resume(engine.approval_token(run.id, approval_id=seen), approved=True)
    run = wait_until_waiting(engine, run.id)
    assert run.waiting is not None and run.waiting.approval_id != seen
    with pytest.raises(InvalidTokenError) as refused:
        engine.approval_token(run.id, approval_id=seen)
    assert refused.value.reason == "stale"
    said = f"waits on approval {run.waiting.approval_id} now (of a post_comment call), not on"
    assert said in str(refused.value)
    assert engine.get_run(run.id).waiting == run.waiting  # unanswered
    assert calls.names() == ["post_comment"]
    with pytest.raises(TypeError, match="approval_id must be text"):
        engine.approval_token(run.id, approval_id=5)  # type: ignore[arg-type]
    token = engine.approval_token(run.id, approval_id=run.waiting.approval_id)
    engine.resume(token, approved=True)
    assert engine.idle(10)
    assert engine.get_run(run.id).status is RunStatus.COMPLETED


def test_a_callable_needs_approval_pauses_only_when_it_says_so(
    make_engine: EngineFactory, calls: Calls
) -> None:
    model = ScriptedModel(
        [
            tool_use("label", {"issue": "1", "label": "bug"}),
            tool_use("label", {"issue": "1", "label": "wontfix"}),
            text("ok"),
        ]
    )
    engine = make_engine([Agent("triage", model, tools=tracker_tools(calls))])
    run = wait_until_waiting(engine, engine.dispatch("triage", trigger({})).id)
    assert calls == [("label", {"issue": "1", "label": "bug"})]
    assert run.waiting is not None and run.waiting.input["label"] == "wontfix"


def test_a_waiting_run_survives_its_engine(make_engine: EngineFactory, calls: Calls) -> None:
    agent, _ = comment_agent(calls)
    first = make_engine([agent])
    run = wait_until_waiting(first, first.dispatch("triage", trigger({})).id)
    token = first.approval_token(run.id)
    first.close()

    second = make_engine([agent])
    second.resume(token, approved=True)
    assert second.idle(10)
    assert second.get_run(run.id).status is RunStatus.COMPLETED
    assert calls.names() == ["post_comment"]


def test_cancel_while_waiting_makes_the_token_stale(
    make_engine: EngineFactory, calls: Calls
) -> None:
    agent, _ = comment_agent(calls)
    engine = make_engine([agent])
    run = wait_until_waiting(engine, engine.dispatch("triage", trigger({})).id)
    token = engine.approval_token(run.id)
    assert engine.cancel(run.id).status is RunStatus.CANCELLED
    with pytest.raises(InvalidTokenError) as err:
        engine.resume(token, approved=True)
    assert err.value.reason == "stale"
    assert calls == []


def test_a_slow_notifier_holds_no_slot_and_is_called_once(
    make_engine: EngineFactory, calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It held its execution's slot (with slots=1 every other run waited for it),
    # and its lock ran out under it: a tick meanwhile called it a second time.
    monkeypatch.setattr("agentruns.approvals._NOTIFY_LOCK_S", 0.5)  # lease_ttl 2 s: 2 s
    notified: list[str] = []
    returned: list[str] = []

    def notifier(run: Run, wait: Any, token: str) -> None:
        notified.append(run.id)
        time.sleep(3)
        returned.append(run.id)

    agent, _ = comment_agent(calls, notifier=notifier)
    quick = Agent("quick", ScriptedModel([text("hi")]))
    engine = make_engine([agent, quick], slots=1)
    waiting = engine.dispatch("triage", trigger({}))
    deadline = time.monotonic() + 10
    while not notified and time.monotonic() < deadline:
        time.sleep(0.01)
    other = engine.dispatch("quick", trigger({}))
    while engine.get_run(other.id).status is not RunStatus.COMPLETED:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert returned == []  # the other run did not wait for the notifier
    time.sleep(2.2)  # past the lock's first TTL, with the notifier still busy
    engine.tick()
    assert engine.idle(10)
    assert notified == [waiting.id]
    assert engine.get_run(waiting.id).waiting.notified_at is not None  # type: ignore[union-attr]


def test_close_waits_for_a_notifier_and_a_key_goes_on_while_it_runs(
    make_engine: EngineFactory, calls: Calls
) -> None:
    # The notifier runs after its execution's slot is let go. close() returned
    # while it ran, and the engine then wrote through its closed store; the key's
    # next run waited for the notifier to return.
    started, returned = threading.Event(), threading.Event()
    said: list[str] = []

    def notifier(run: Run, wait: Any, token: str) -> None:
        started.set()
        try:
            engine.idle()
        except RuntimeError as exc:
            said.append(str(exc).split(":")[0])
        time.sleep(1.5)
        returned.set()

    agent, _ = comment_agent(calls, notifier=notifier)
    quick = Agent("quick", ScriptedModel([text("hi")]))
    engine = make_engine([agent, quick], scheduler=ManualScheduler())
    first = engine.dispatch("triage", trigger({}), concurrency_key="k")
    second = engine.dispatch("quick", trigger({}), concurrency_key="k")
    runner = threading.Thread(target=engine.execute, args=(first.id,))
    runner.start()
    assert started.wait(10)
    # Scheduled at its dispatch, and again, before the notifier, as the key's next.
    assert engine.scheduler.scheduled.count(second.id) == 2  # type: ignore[attr-defined]
    engine.close()
    assert returned.is_set()
    runner.join(5)
    assert said == [
        "idle() cannot be called from inside one of this engine's executions"
        " (a tool, listener or notifier)"
    ]


def _answers_with_its_transcript() -> Agent:
    return Agent("quick", ScriptedModel(lambda messages: text(f"saw {len(messages)}")))


def test_a_run_waiting_on_an_approval_holds_its_thread_until_it_ends(
    make_engine: EngineFactory, calls: Calls
) -> None:
    # A waiting run let its thread's next run go ahead, from the run completed
    # before it: that run never saw the waiting one, and the run after both
    # continued whichever completed last, dropping the other's exchange.
    agent, _ = comment_agent(calls)
    engine = make_engine([agent, _answers_with_its_transcript()], requeue_after=0.2)
    first = engine.dispatch("triage", trigger({}), thread="t")
    wait_until_waiting(engine, first.id)
    second = engine.dispatch("quick", trigger({"q": 2}), thread="t")
    assert engine.idle(10)
    assert engine.execute(second.id).status is RunStatus.QUEUED  # held by the waiting run
    time.sleep(0.3)
    assert engine.recover() == []  # a held run is not lost: recover leaves it
    other = engine.dispatch("quick", trigger({}), thread="u")  # another thread goes on
    assert engine.idle(10)
    assert engine.get_run(other.id).status is RunStatus.COMPLETED
    assert engine.get_run(second.id).status is RunStatus.QUEUED

    engine.resume(engine.approval_token(first.id), approved=True)
    assert engine.idle(10)
    assert engine.get_run(first.id).status is RunStatus.COMPLETED
    assert calls.names() == ["post_comment"]
    # The second run continues the first's whole exchange: its trigger, the call,
    # the result, the answer, then its own trigger.
    assert engine.get_run(second.id).output == "saw 5"


def test_a_waiting_run_cancelled_lets_its_thread_go_on(
    make_engine: EngineFactory, calls: Calls
) -> None:
    agent, _ = comment_agent(calls)
    engine = make_engine([agent, _answers_with_its_transcript()])
    first = engine.dispatch("triage", trigger({}), thread="t")
    wait_until_waiting(engine, first.id)
    second = engine.dispatch("quick", trigger({}), thread="t")
    assert engine.idle(10)
    assert engine.get_run(second.id).status is RunStatus.QUEUED
    assert engine.cancel(first.id).status is RunStatus.CANCELLED
    assert engine.idle(10)
    # From the thread's last completed run: none, so from its own trigger alone.
    assert engine.get_run(second.id).output == "saw 1"
    assert calls.names() == []


def test_a_waiting_run_holds_only_its_threads_own_line(
    make_engine: EngineFactory, calls: Calls
) -> None:
    # Held by thread and key, a waiting run of a thread given a key of its own held
    # that whole key: the queued run of its thread it held was first in the key's
    # line, and every later run of the key (other threads, no thread) waited too.
    agent, _ = comment_agent(calls)
    engine = make_engine([agent, _answers_with_its_transcript()])
    first = engine.dispatch("triage", trigger({}), thread="t", concurrency_key="customer:42")
    wait_until_waiting(engine, first.id)
    same_thread = engine.dispatch("quick", trigger({}), thread="t", concurrency_key="customer:42")
    other_thread = engine.dispatch("quick", trigger({}), thread="u", concurrency_key="customer:42")
    no_thread = engine.dispatch("quick", trigger({}), concurrency_key="customer:42")
    assert engine.idle(10)
    for run in (same_thread, other_thread, no_thread):
        assert engine.get_run(run.id).status is RunStatus.COMPLETED
    assert engine.get_run(first.id).status is RunStatus.WAITING
