"""Crashes and lease loss with real processes: kill -9 and SIGSTOP, then recovery elsewhere."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from agentruns import Engine, FatalToolError, LeaseLostError, Run, RunStatus
from agentruns.runs import utcnow
from agentruns.schedulers import ManualScheduler
from tests.conftest import EngineFactory, trigger, wait_for
from tests.support import agents
from tests.support.agents import AGENTS, STEPS, steps_agent

ROOT = Path(__file__).resolve().parent.parent


class Helper:
    """A child process executing one run in an engine of its own."""

    def __init__(self, log: Path, proc: subprocess.Popen[bytes]) -> None:
        self.log = log
        self.proc = proc

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def wait_for_line(self, needle: str, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(needle in line for line in self.lines()):
            if self.proc.poll() is not None:
                raise AssertionError(f"helper exited early: {self.lines()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {needle!r} in {self.lines()}")
            time.sleep(0.02)


@pytest.fixture
def spawn(
    db_url: str, redis_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    log = tmp_path / "calls.log"
    monkeypatch.setenv("AGENTRUNS_TEST_LOG", str(log))
    procs: list[subprocess.Popen[bytes]] = []

    def start(
        run_id: str,
        hang: str | None = None,
        lease_ttl: float = 1.0,
        clock_ahead: float = 0,
        pause: str | None = None,
        fail: str | None = None,
    ) -> Helper:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "AGENTRUNS_TEST_LOG": str(log)}
        if hang:
            env["AGENTRUNS_TEST_HANG"] = hang
        if pause:
            env["AGENTRUNS_TEST_PAUSE"] = pause
        if fail:
            env["AGENTRUNS_TEST_FAIL"] = fail
        if clock_ahead:
            env["AGENTRUNS_TEST_CLOCK_AHEAD"] = str(clock_ahead)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.executor",
                db_url,
                redis_prefix,
                run_id,
                str(lease_ttl),
            ],
            cwd=ROOT,
            env=env,
        )
        procs.append(proc)
        return Helper(log, proc)

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait()


def kill9(helper: Helper) -> None:
    helper.proc.send_signal(signal.SIGKILL)
    helper.proc.wait()


def recover_when_lease_expires(engine: Engine, run_id: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while run_id not in engine.recover():
        if time.monotonic() > deadline:
            raise AssertionError(f"run {run_id} was never recovered")
        time.sleep(0.1)


def llm_turns(engine: Engine, run_id: str) -> int:
    return sum(1 for s in engine.steps(run_id) if s.kind == "llm")


def test_recovered_run_never_asks_the_model_again_for_a_saved_response(
    make_engine: EngineFactory, spawn: Any
) -> None:
    producer = make_engine(AGENTS, scheduler=ManualScheduler())
    run = producer.dispatch("steps", trigger({"n": 1}))
    helper = spawn(run.id)
    helper.wait_for_line("note two")  # two model responses saved, a third call comes
    kill9(helper)
    saved = llm_turns(producer, run.id)
    assert saved >= 2
    assert producer.get_run(run.id).status is RunStatus.RUNNING

    before = len(steps_agent.model.calls)  # type: ignore[attr-defined]
    rescuer = make_engine(AGENTS)
    recover_when_lease_expires(rescuer, run.id)
    assert rescuer.idle(20)
    done = rescuer.get_run(run.id)
    assert done.status is RunStatus.COMPLETED and done.output == "Done."

    steps = rescuer.steps(run.id)
    assert [s.index for s in steps] == list(range(len(steps)))
    assert llm_turns(rescuer, run.id) == len(STEPS)
    calls_here = steps_agent.model.calls[before:]  # type: ignore[attr-defined]
    turns_here = [sum(m["role"] == "assistant" for m in c) for c in calls_here]
    assert min(turns_here) >= saved  # nothing the dead process saved was asked again


def test_a_run_whose_step_kills_its_worker_is_held_back_before_it_is_handed_on_again(
    make_engine: EngineFactory, spawn: Any
) -> None:
    # Each sweep handed it to another worker, which it killed too, with every run
    # that worker held.
    producer = make_engine(AGENTS, scheduler=ManualScheduler(), requeue_after=4.0)
    run = producer.dispatch("crash", trigger({}))
    for losses in range(2):
        helper = spawn(run.id)
        assert helper.proc.wait(timeout=20) == -signal.SIGKILL
        assert helper.lines().count("crash") == losses + 1
        claim = producer.get_run(run.id).claim
        assert claim is not None
        expires = claim.expires_at
        wait_for(lambda: utcnow() > expires, "the dead worker's claim to expire")  # noqa: B023
        if losses:  # lost again at its step: held back 2-6 s past its claim's expiry
            assert producer.recover() == []
            assert producer.get_run(run.id).status is RunStatus.RUNNING
        recover_when_lease_expires(producer, run.id, timeout=20)
    assert producer.get_run(run.id).status is RunStatus.QUEUED  # held back, never failed
    assert [s.kind for s in producer.steps(run.id)] == ["llm"]
    assert producer.cancel(run.id).status is RunStatus.CANCELLED


def test_a_killed_worker_whose_clock_was_ahead_is_recovered_once_its_lease_expires(
    make_engine: EngineFactory, spawn: Any
) -> None:
    # Its claim's expiry, written by its own clock, lay 40 s in the future: recover
    # waited for that, though its lease in Redis had expired after 1 s.
    producer = make_engine(AGENTS, scheduler=ManualScheduler())
    run = producer.dispatch("steps", trigger({"n": 1}))
    helper = spawn(run.id, clock_ahead=40)
    helper.wait_for_line("note two")
    kill9(helper)
    claim = producer.get_run(run.id).claim
    assert claim is not None and claim.expires_at > utcnow() + timedelta(seconds=30)

    rescuer = make_engine(AGENTS)
    recover_when_lease_expires(rescuer, run.id, timeout=10)
    assert rescuer.idle(20)
    assert rescuer.get_run(run.id).status is RunStatus.COMPLETED


def test_effect_tool_runs_once_when_killed_after_it_ran_before_its_step_was_saved(
    make_engine: EngineFactory, spawn: Any
) -> None:
    producer = make_engine(AGENTS, scheduler=ManualScheduler())
    run = producer.dispatch("effects", trigger({}))
    helper = spawn(run.id, hang="slow")  # charge ran and was recorded; slow hangs
    helper.wait_for_line("hanging slow")
    kill9(helper)

    rescuer = make_engine(AGENTS)
    recover_when_lease_expires(rescuer, run.id)
    assert rescuer.idle(20)
    assert rescuer.get_run(run.id).error is None
    assert rescuer.get_run(run.id).status is RunStatus.COMPLETED
    charges = [line for line in helper.lines() if line.startswith("charge")]
    assert len(charges) == 1
    tool_steps = [s for s in rescuer.steps(run.id) if s.kind == "tool"]
    assert [s.name for s in tool_steps] == ["charge", "slow"]
    assert tool_steps[0].output == {"charged": 5, "key": charges[0].split()[1]}


def stopped_inside_the_charge(
    make_engine: EngineFactory, spawn: Any, fail: str | None = None
) -> tuple[Engine, Run, Helper]:
    """A run of the effects agent whose process is stopped (SIGSTOP) inside its charge,
    which takes a second (and then fails, with ``fail="charge"``), and requeued by a
    rescuer (which executes only when the test says) once its lease expired."""
    producer = make_engine(AGENTS, scheduler=ManualScheduler())
    run = producer.dispatch("effects", trigger({}))
    helper = spawn(run.id, pause="charge", fail=fail)
    helper.wait_for_line("charge ")
    helper.proc.send_signal(signal.SIGSTOP)
    # (A run lost twice at one step is held back: half a second to 1.5 s here.)
    rescuer = make_engine(AGENTS, scheduler=ManualScheduler(), requeue_after=0.5)
    recover_when_lease_expires(rescuer, run.id)
    return rescuer, run, helper


def stopped_before_its_charge_fails(
    make_engine: EngineFactory, spawn: Any, monkeypatch: pytest.MonkeyPatch
) -> tuple[Engine, Run, Helper]:
    """A run of ``unknown_approve`` whose process is stopped (SIGSTOP) inside its charge,
    which takes a second and then raises FatalToolError (its call failed), and a rescuer
    (which executes only when the test says) once its lease expired."""
    producer = make_engine(AGENTS, scheduler=ManualScheduler())
    run = producer.dispatch("unknown_approve", trigger({}))
    monkeypatch.setenv("AGENTRUNS_TEST_FATAL", "charge")
    first = spawn(run.id, pause="charge")
    monkeypatch.delenv("AGENTRUNS_TEST_FATAL")
    first.wait_for_line("charge ")
    first.proc.send_signal(signal.SIGSTOP)
    rescuer = make_engine(AGENTS, scheduler=ManualScheduler(), requeue_after=0.5)
    recover_when_lease_expires(rescuer, run.id)
    return rescuer, run, first


def test_a_stopped_owner_starts_no_call_once_it_goes_on_past_its_lease(
    make_engine: EngineFactory, spawn: Any
) -> None:
    # Going on after SIGCONT, its thread made the step's next call (a call the run's
    # new holder had made) before the keeper's next look, within milliseconds, and
    # a tool that asked ctx.signal first was told to go on.
    producer = make_engine(AGENTS, scheduler=ManualScheduler())
    run = producer.dispatch("two_calls", trigger({}))
    helper = spawn(run.id, pause="first")
    helper.wait_for_line("executor started")
    wait_for(lambda: producer.get_run(run.id).steps_used == 1 or None, "the model step")
    time.sleep(0.3)  # inside the first call's second
    helper.proc.send_signal(signal.SIGSTOP)
    rescuer = make_engine(AGENTS, scheduler=ManualScheduler(), requeue_after=0.5)
    recover_when_lease_expires(rescuer, run.id)
    assert rescuer.execute(run.id).status is RunStatus.COMPLETED
    helper.proc.send_signal(signal.SIGCONT)
    assert helper.proc.wait(timeout=20) == 0
    lines = helper.lines()
    assert f"first {helper.proc.pid} signal True" in lines, lines
    assert [line for line in lines if line.startswith("second")] == [f"second {os.getpid()}"]
    assert "error LeaseLostError" in lines


def test_an_effect_call_a_stopped_owner_finished_is_recorded_and_not_made_again(
    make_engine: EngineFactory, spawn: Any
) -> None:
    # A worker paused past its lease inside an effect tool finished the call when it
    # went on, but its result record was refused (fenced by epoch): the next
    # execution found an intent without a result and made the call again, no crash
    # involved.
    rescuer, run, helper = stopped_inside_the_charge(make_engine, spawn)
    helper.proc.send_signal(signal.SIGCONT)
    assert helper.proc.wait(timeout=20) == 0
    assert "error LeaseLostError" in helper.lines()
    assert rescuer.execute(run.id).status is RunStatus.COMPLETED
    charges = [line for line in helper.lines() if line.startswith("charge")]
    assert len(charges) == 1, charges
    tool_steps = [s for s in rescuer.steps(run.id) if s.kind == "tool"]
    assert tool_steps[0].output == {"charged": 5, "key": charges[0].split()[1]}


@pytest.mark.parametrize("then", ["fatal", "error"])
def test_a_stopped_owners_late_charge_is_kept_when_the_call_made_again_fails(
    make_engine: EngineFactory, spawn: Any, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    # The paused worker went on while the run's new holder called again, and charged.
    # fatal: its result was refused (a later attempt was under way), that attempt then
    # raised FatalToolError and handed the intent back to the first, whose result was
    # gone; a retry of the run charged a third time. error: the holder's error ("a
    # charge with this key exists") replaced the success, and the model was told the
    # charge failed.
    rescuer, run, first = stopped_inside_the_charge(make_engine, spawn)

    def goes_on_meanwhile_then_fails(name: str) -> None:
        first.proc.send_signal(signal.SIGCONT)
        assert first.proc.wait(timeout=20) == 0  # its charge recorded, or refused
        if then == "fatal":
            raise FatalToolError("declined: a charge with this key is under way")
        raise RuntimeError("a charge with this key exists")

    calls_as_it_does = agents.hang_here
    monkeypatch.setattr(agents, "hang_here", goes_on_meanwhile_then_fails)
    done = rescuer.execute(run.id)
    assert "error LeaseLostError" in first.lines()
    monkeypatch.setattr(agents, "hang_here", calls_as_it_does)
    if then == "fatal":
        assert done.error is not None and done.error.code == "fatal_tool_error"
        rescuer.retry(run.id)
        done = rescuer.execute(run.id)
    assert done.status is RunStatus.COMPLETED
    charges = charge_keys(first)
    assert len(charges) == 2 and charges[0] == charges[1]  # not a third time
    charged = [s for s in rescuer.steps(run.id) if s.kind == "tool" and s.name == "charge"]
    assert charged[-1].output == {"charged": 5, "key": charges[0]}  # the first's


def test_an_intent_its_stopped_owner_forgot_meanwhile_is_not_taken_for_unknown(
    make_engine: EngineFactory, spawn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The paused worker's call said it failed (FatalToolError), and it deleted its
    # intent after the run's new holder had read it: the holder's read again found
    # none, fell back on what it had read, and asked a person whether a call known to
    # have failed had happened.
    rescuer, run, first = stopped_before_its_charge_fails(make_engine, spawn, monkeypatch)
    reads = rescuer.store.effects

    def read_then_let_the_first_go_on(run_id: str) -> Any:
        read = reads(run_id)
        monkeypatch.setattr(rescuer.store, "effects", reads)
        first.proc.send_signal(signal.SIGCONT)
        assert first.proc.wait(timeout=20) == 0
        return read

    monkeypatch.setattr(rescuer.store, "effects", read_then_let_the_first_go_on)
    assert rescuer.execute(run.id).status is RunStatus.COMPLETED  # nobody asked
    assert "error LeaseLostError" in first.lines()
    assert len(charge_keys(first)) == 2


def test_a_stopped_owners_effect_outcome_does_not_stand_for_a_later_attempts(
    make_engine: EngineFactory, spawn: Any
) -> None:
    # A paused worker's charge failed ("not charged") after the run's next holder had
    # charged again and died before recording it: the paused one's error was recorded
    # as the call's outcome, and the model told the charge failed.
    rescuer, run, first = stopped_inside_the_charge(make_engine, spawn, fail="charge")
    second = spawn(run.id, hang="charge")  # charges, then dies before its record
    second.wait_for_line("hanging charge")
    first.proc.send_signal(signal.SIGCONT)
    assert first.proc.wait(timeout=20) == 0
    kill9(second)
    recover_when_lease_expires(rescuer, run.id)
    assert rescuer.execute(run.id).status is RunStatus.COMPLETED  # charges again
    assert len(charge_keys(first)) == 3
    tool_steps = [s for s in rescuer.steps(run.id) if s.kind == "tool"]
    assert tool_steps[0].error is None and tool_steps[0].output["charged"] == 5  # type: ignore[index]


def killed_inside_the_charge(
    make_engine: EngineFactory, spawn: Any, agent: str, approve_first: bool = False
) -> tuple[Engine, Run, Helper]:
    """A run of ``agent`` whose process is killed inside its effect tool, then recovered.

    ``approve_first``: the tool needs approval; it is given before the call."""
    producer = make_engine(AGENTS, scheduler=ManualScheduler())
    run = producer.dispatch(agent, trigger({}))
    if approve_first:
        assert producer.execute(run.id).status is RunStatus.WAITING
        producer.resume(producer.approval_token(run.id), approved=True)
    helper = spawn(run.id, hang="charge")  # the intent is recorded, the result never is
    helper.wait_for_line("hanging charge")
    kill9(helper)

    rescuer = make_engine(AGENTS)
    recover_when_lease_expires(rescuer, run.id)
    assert rescuer.idle(20)
    return rescuer, run, helper


def charge_keys(helper: Helper) -> list[str]:
    """The idempotency key of every call of the charge tool, in any process."""
    return [line.split()[1] for line in helper.lines() if line.startswith("charge")]


def test_unknown_effect_outcome_with_retry_calls_again_with_the_same_key(
    make_engine: EngineFactory, spawn: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rescuer, run, helper = killed_inside_the_charge(make_engine, spawn, "unknown_retry")
    assert rescuer.get_run(run.id).status is RunStatus.COMPLETED
    charges = charge_keys(helper)
    assert len(charges) == 2 and charges[0] == charges[1]
    # Said, as the one call an operator may need to check (it left no other trace).
    said = f"run {run.id} calls effect tool charge again (idempotency key {charges[0]})"
    assert said in caplog.text


# An approval given before the first attempt covers that attempt only: after the crash,
# on_unknown decides as it would for a tool that needs no approval.
@pytest.mark.parametrize(
    ("agent", "approve_first"), [("unknown_fail", False), ("approved_fail", True)]
)
def test_unknown_effect_outcome_with_fail_fails_the_run(
    make_engine: EngineFactory, spawn: Any, agent: str, approve_first: bool
) -> None:
    rescuer, run, helper = killed_inside_the_charge(make_engine, spawn, agent, approve_first)
    failed = rescuer.get_run(run.id)
    assert failed.status is RunStatus.FAILED
    assert failed.error is not None and failed.error.code == "effect_outcome_unknown"
    assert len(charge_keys(helper)) == 1


@pytest.mark.parametrize(
    ("agent", "approve_first", "tool"),
    [("unknown_approve", False, "charge_or_ask"), ("approved_ask", True, "approved_charge_or_ask")],
)
def test_unknown_effect_outcome_with_approve_asks_a_human_before_calling_again(
    make_engine: EngineFactory, spawn: Any, agent: str, approve_first: bool, tool: str
) -> None:
    rescuer, run, helper = killed_inside_the_charge(make_engine, spawn, agent, approve_first)
    waiting = rescuer.get_run(run.id)
    assert waiting.status is RunStatus.WAITING
    assert waiting.waiting is not None and waiting.waiting.tool_name == tool
    assert len(charge_keys(helper)) == 1

    rescuer.resume(rescuer.approval_token(run.id), approved=True)
    assert rescuer.idle(20)
    assert rescuer.get_run(run.id).status is RunStatus.COMPLETED
    charges = charge_keys(helper)
    assert len(charges) == 2 and charges[0] == charges[1]
    answers = [s.output["approved"] for s in rescuer.steps(run.id) if s.kind == "wait"]
    assert answers == [True] * (2 if approve_first else 1)


def test_denying_a_call_again_after_an_unknown_outcome_tells_the_model_it_may_have_happened(
    make_engine: EngineFactory, spawn: Any
) -> None:
    # It was told "The call was denied", as if nothing had been charged.
    rescuer, run, helper = killed_inside_the_charge(make_engine, spawn, "unknown_approve")
    assert rescuer.get_run(run.id).status is RunStatus.WAITING
    rescuer.resume(rescuer.approval_token(run.id), approved=False, reason="see the ledger")
    assert rescuer.idle(20)
    assert rescuer.get_run(run.id).status is RunStatus.COMPLETED
    assert len(charge_keys(helper)) == 1
    checkpoint = rescuer.checkpoint(run.id)
    assert checkpoint is not None
    results = [
        block
        for message in checkpoint.messages
        if message["role"] == "user" and isinstance(message["content"], list)
        for block in message["content"]
        if block.get("type") == "tool_result"
    ]
    told = json.dumps(results[-1])
    assert results[-1]["is_error"] and "may have happened" in told and "see the ledger" in told


def test_denying_a_call_again_whose_first_attempt_was_recorded_since_gives_its_result(
    make_engine: EngineFactory, spawn: Any
) -> None:
    # A paused worker recorded the first attempt's result while a person was asked
    # whether to call again: their no told the model the charge "may have happened".
    rescuer, run, helper = killed_inside_the_charge(make_engine, spawn, "unknown_approve")
    assert rescuer.get_run(run.id).status is RunStatus.WAITING
    (intent,) = rescuer.store.effects(run.id).values()
    assert not intent.done
    with pytest.raises(LeaseLostError):  # as the first execution would, going on
        rescuer.store.finish_effect(run.id, 1, intent, {"charged": 5}, False)
    rescuer.resume(rescuer.approval_token(run.id), approved=False, reason="see the ledger")
    assert rescuer.idle(20)
    assert rescuer.get_run(run.id).status is RunStatus.COMPLETED
    assert len(charge_keys(helper)) == 1  # not called again
    charge = next(s for s in rescuer.steps(run.id) if s.kind == "tool")
    assert charge.error is None and charge.output == {"charged": 5}
    wait = next(s for s in rescuer.steps(run.id) if s.kind == "wait")
    assert wait.output is not None and wait.output["approved"] is False  # what was answered


def test_a_call_made_again_and_its_paused_first_both_saying_they_failed_leave_no_unknown(
    make_engine: EngineFactory, spawn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The paused worker's call said it failed while the call a person approved was
    # made again, which then said it failed too: it handed the intent back to the
    # first, and a retry asked the person again about a call known to have failed.
    rescuer, run, first = stopped_before_its_charge_fails(make_engine, spawn, monkeypatch)
    assert rescuer.execute(run.id).status is RunStatus.WAITING  # asked whether to call again

    def first_fails_meanwhile_then_this_one(name: str) -> None:
        first.proc.send_signal(signal.SIGCONT)
        assert first.proc.wait(timeout=20) == 0
        raise FatalToolError("declined: nothing charged this time")

    calls_as_it_does = agents.hang_here
    monkeypatch.setattr(agents, "hang_here", first_fails_meanwhile_then_this_one)
    rescuer.resume(rescuer.approval_token(run.id), approved=True)
    failed = rescuer.execute(run.id)
    assert failed.error is not None and failed.error.code == "fatal_tool_error"
    monkeypatch.setattr(agents, "hang_here", calls_as_it_does)
    assert rescuer.store.effects(run.id) == {}  # no attempt of unknown outcome left
    rescuer.retry(run.id)
    assert rescuer.execute(run.id).status is RunStatus.COMPLETED  # nobody asked again
    assert len(charge_keys(first)) == 3


def test_denying_a_call_again_whose_first_attempt_said_it_failed_since_is_a_plain_denial(
    make_engine: EngineFactory, spawn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The paused worker's call said it failed (FatalToolError) while a person was asked
    # whether to call again: their no told the model the call "may have happened".
    rescuer, run, first = stopped_before_its_charge_fails(make_engine, spawn, monkeypatch)
    assert rescuer.execute(run.id).status is RunStatus.WAITING
    first.proc.send_signal(signal.SIGCONT)
    assert first.proc.wait(timeout=20) == 0
    assert rescuer.store.effects(run.id) == {}  # its intent deleted
    rescuer.resume(rescuer.approval_token(run.id), approved=False, reason="not now")
    assert rescuer.execute(run.id).status is RunStatus.COMPLETED
    assert len(charge_keys(first)) == 1
    (charge,) = [s for s in rescuer.steps(run.id) if s.kind == "tool"]
    told = json.dumps([charge.output, charge.error])
    assert "The call was denied: not now" in told and "may have happened" not in told


def test_a_call_again_that_says_it_failed_leaves_the_first_attempts_outcome_unknown(
    make_engine: EngineFactory, spawn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The attempt a person approved after the crash raised FatalToolError, and the run
    # failed: the intent deleted with it was the first attempt's too, so a retry took
    # the call for never made and called it a third time, nobody asked.
    rescuer, run, helper = killed_inside_the_charge(make_engine, spawn, "unknown_approve")
    assert rescuer.get_run(run.id).status is RunStatus.WAITING
    (first,) = rescuer.store.effects(run.id).values()
    monkeypatch.setenv("AGENTRUNS_TEST_FATAL", "charge")
    rescuer.resume(rescuer.approval_token(run.id), approved=True)
    assert rescuer.idle(20)
    failed = rescuer.get_run(run.id)
    assert failed.error is not None and failed.error.code == "fatal_tool_error"
    monkeypatch.delenv("AGENTRUNS_TEST_FATAL")
    rescuer.retry(run.id)
    assert rescuer.idle(20)
    waiting = rescuer.get_run(run.id)
    assert waiting.status is RunStatus.WAITING  # asked again, not called a third time
    assert len(charge_keys(helper)) == 2
    # The intent is the first attempt's again: had its worker only been paused, its
    # result, recorded as it goes on, is kept (it was refused, as a later attempt's
    # was the one to keep), and the call is not made again.
    with pytest.raises(LeaseLostError, match="the call's result is recorded"):
        rescuer.store.finish_effect(run.id, 1, first, {"charged": 5}, False)
    rescuer.resume(rescuer.approval_token(run.id), approved=True)
    assert rescuer.idle(20)
    assert rescuer.get_run(run.id).status is RunStatus.COMPLETED
    assert len(charge_keys(helper)) == 2
    charged = [s for s in rescuer.steps(run.id) if s.kind == "tool" and s.name == "charge_or_ask"]
    assert charged[-1].output == {"charged": 5}


@pytest.mark.parametrize(
    ("agent", "approve_first"), [("unknown_approve", False), ("approved_ask", True)]
)
def test_an_approval_to_call_again_covers_one_attempt_and_another_crash_asks_again(
    make_engine: EngineFactory, spawn: Any, agent: str, approve_first: bool
) -> None:
    rescuer, run, helper = killed_inside_the_charge(make_engine, spawn, agent, approve_first)
    assert rescuer.get_run(run.id).status is RunStatus.WAITING
    answerer = make_engine(AGENTS, scheduler=ManualScheduler())
    answerer.resume(answerer.approval_token(run.id), approved=True)

    second = spawn(run.id, hang="charge")  # the approved attempt dies as the first did
    wait_for(lambda: len(charge_keys(second)) == 2, "the approved attempt")
    wait_for(lambda: sum("hanging charge" in line for line in second.lines()) == 2, "its hang")
    kill9(second)
    recover_when_lease_expires(rescuer, run.id)
    assert rescuer.idle(20)
    waiting = rescuer.get_run(run.id)
    assert waiting.status is RunStatus.WAITING  # asked again, not called a third time
    assert len(charge_keys(helper)) == 2

    rescuer.resume(rescuer.approval_token(run.id), approved=True)
    assert rescuer.idle(20)
    assert rescuer.get_run(run.id).status is RunStatus.COMPLETED
    charges = charge_keys(helper)
    assert len(charges) == 3 and len(set(charges)) == 1


def test_a_stopped_owner_loses_the_run_and_writes_nothing_after_it_continues(
    make_engine: EngineFactory, spawn: Any
) -> None:
    producer = make_engine(AGENTS, scheduler=ManualScheduler())
    run = producer.dispatch("steps", trigger({"n": 2}))
    helper = spawn(run.id)
    helper.wait_for_line("note one")
    helper.proc.send_signal(signal.SIGSTOP)
    stopped_steps = producer.steps(run.id)

    rescuer = make_engine(AGENTS)
    recover_when_lease_expires(rescuer, run.id)
    assert rescuer.idle(20)
    done = rescuer.get_run(run.id)
    assert done.status is RunStatus.COMPLETED
    steps_after_rescue = rescuer.steps(run.id)

    helper.proc.send_signal(signal.SIGCONT)
    assert helper.proc.wait(timeout=20) == 0
    assert any(line == "error LeaseLostError" for line in helper.lines())
    # The continued process wrote nothing more: same steps, run still completed.
    assert rescuer.steps(run.id) == steps_after_rescue
    assert rescuer.get_run(run.id).status is RunStatus.COMPLETED
    assert len(steps_after_rescue) > len(stopped_steps)
    assert [s.index for s in steps_after_rescue] == list(range(len(steps_after_rescue)))
    assert llm_turns(rescuer, run.id) == len(STEPS)
