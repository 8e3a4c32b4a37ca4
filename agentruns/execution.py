"""One execution: a claimed run, driven from its latest checkpoint until it settles or pauses.

Every write is one transaction guarded by the run's status and fencing epoch
(see ``SqlStore.commit``). A step with tool calls is two writes: the model's
response first, then the tool results with the checkpoint, so a recovered run
never asks the model again for a response that was saved.

While a step is paused on approvals, the answers and the results of the calls
that already ran are kept in the run's ``pending`` map (``pending.py``).
The tool-result message is appended only once every call has its result, so
stored messages stay append-only and the transcript stays valid.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from enum import StrEnum
from typing import Any, Protocol, TypeVar

from pydantic import ValidationError

from agentruns import pending as pending_
from agentruns import replies, transcript
from agentruns.agent import Agent, RunContext
from agentruns.errors import (
    FatalToolError,
    InvalidCheckpointError,
    LeaseLostError,
    exception_text,
    stops_the_task,
)
from agentruns.events import Events
from agentruns.models.base import ModelAborted, ModelError, ModelRequest, ModelResponse
from agentruns.runs import (
    Budget,
    Run,
    RunError,
    RunStatus,
    Usage,
    WaitPoint,
    utcnow,
)
from agentruns.store.base import Claimed, Commit, Committed, Guard, NewStep, Store
from agentruns.store.schema import THREAD_KEY
from agentruns.toolcalls import EffectOutcomeUnknown, Outcome, ToolCaller, Wait
from agentruns.tools import StateHolder, Tool
from agentruns.tools import state_tools as make_state_tools

log = logging.getLogger("agentruns")


class Host(Protocol):
    """What an execution needs from the engine that runs it."""

    store: Store
    events: Events

    def report(self, exc: Exception, *, what: str | None = None) -> None: ...

    def published(self, committed: Committed) -> None: ...

    def is_infrastructure_error(self, exc: Exception) -> bool: ...

    def cancel(self, run_id: str) -> Run: ...


class Abort(StrEnum):
    CANCEL = "cancel"
    DRAIN = "drain"
    TIMEOUT = "timeout"
    LEASE_LOST = "lease_lost"


T = TypeVar("T")


class _Stop(Exception):
    """Internal: the execution has settled, paused, or must stop writing."""


class _CallFailed(Exception):
    """Internal: a tool call failed the run (``fatal_tool_error``, or an effect's unknown
    outcome with ``on_unknown="fail"``), with its step row if it has one."""

    def __init__(self, error: RunError, step: NewStep | None) -> None:
        super().__init__(error.message)
        self.error = error
        self.step = step


class _AgentCodeFailed(Exception):
    """Internal: the agent's own code (its instructions or tools callable) raised. The
    run fails: what it raised, an ``OSError`` included, is no outage of agentruns'
    to wait out, and would raise again in every recovery."""

    def __init__(self, what: str, raised: BaseException) -> None:
        super().__init__(f"{what}: {exception_text(raised)}")
        # What on_error is given: an Exception (a SystemExit is said by this one).
        self.raised: Exception = raised if isinstance(raised, Exception) else self
        self.__cause__ = raised


def _agents_own(what: str, call: Callable[[], T]) -> T:
    """The agent's own code's result; what it raises fails the run, ``SystemExit`` from
    argparse too (raised on, the execution's thread ended with its run left running,
    for every recover to requeue it and be killed again), unless it stops the task."""
    try:
        return call()
    except BaseException as exc:
        if stops_the_task(exc):
            raise
        raise _AgentCodeFailed(what, exc) from exc


class _Signal(threading.Event):
    """An execution's abort signal (``ctx.signal``). Asked whether it is set, it also
    looks at the lease: a tool that asks before it acts hears of a lease gone past
    due at once, not at the keeper's next look (up to 0.1 s after a paused process
    goes on)."""

    def __init__(self, lapsed: Callable[[], bool]) -> None:
        super().__init__()
        self._lapsed = lapsed

    def is_set(self) -> bool:
        return super().is_set() or self._lapsed()


class Execution:
    """Drives one claimed run. ``abort()`` may be called from any thread."""

    def __init__(self, engine: Host, agent: Agent, claimed: Claimed) -> None:
        self.engine = engine
        self.store = engine.store
        self.agent = agent
        self.run = claimed.run
        self.epoch = claimed.epoch
        self.start = claimed.transcript
        # Until when (``time.monotonic``) the lease is known held: the keeper's to say.
        self.lease_ends: Callable[[], float] = lambda: math.inf
        self.signal = _Signal(self._lapsed)
        self.reason: Abort | None = None
        self._guard = Guard(status=RunStatus.RUNNING, epoch=self.epoch)
        self._saved = False  # whether this execution committed a write
        self._step_started = utcnow()
        # The ids of the transcript's tool calls: a reply's call with one gets another.
        self._call_ids: set[str] = set()

    @property
    def run_id(self) -> str:
        return self.run.id

    def _lapsed(self) -> bool:
        """Is the lease past due? Then the execution is aborted as lost, now: a process
        stopped past its lease (SIGSTOP, a VM paused) goes on where it stopped, before
        the keeper's next look, and must start no call another process made since."""
        if time.monotonic() < self.lease_ends():
            return False
        self.abort(Abort.LEASE_LOST)
        return True

    def _holds_lease(self) -> bool:
        return not (self.signal.is_set() and self.reason is Abort.LEASE_LOST)

    def abort(self, reason: Abort) -> None:
        # The first reason decides how the execution settles, except a lost lease:
        # after that, whatever came first, it must write nothing more.
        if self.reason is None or reason is Abort.LEASE_LOST:
            self.reason = reason
        self.signal.set()

    # -- the whole execution -------------------------------------------------

    def execute(self) -> Run:
        try:
            self._execute()
        except _Stop:
            pass
        except LeaseLostError as exc:
            self.engine.report(exc)
        except InvalidCheckpointError as exc:
            self._settle_quietly(
                RunStatus.FAILED, RunError(code="invalid_checkpoint", message=str(exc))
            )
        except _AgentCodeFailed as exc:
            self.engine.report(exc.raised)
            error = RunError(code="internal_error", message=str(exc))
            self._settle_quietly(RunStatus.FAILED, error)
        except Exception as exc:
            if stops_the_task(exc):
                self._stopped(exc)
                return self.run
            self.engine.report(exc, what=f"run {self.run.id} let go, for recover")
            if not self.engine.is_infrastructure_error(exc):
                error = RunError(code="internal_error", message=exception_text(exc))
                self._settle_quietly(RunStatus.FAILED, error)
        return self.run

    def _execute(self) -> None:
        ctx = RunContext(
            run_id=self.run.id,
            agent=self.agent.name,
            trigger=self.run.trigger,
            thread=self.run.thread,
            signal=self.signal,
        )
        messages, unsaved, pending, state = self._load()
        self.unsaved = unsaved
        self.state = StateHolder(state)
        self.caller = ToolCaller(
            self.store,
            self.run.id,
            self.epoch,
            self._assemble_tools(ctx),
            self.signal,
            self._holds_lease,
        )

        if self.run.cancel_requested:
            self._settle(RunStatus.CANCELLED)
        tail = messages[-1]
        if tail["role"] == "assistant":
            calls = transcript.tool_calls(tail)
            if not calls:  # a final answer whose settle did not happen
                self._settle(RunStatus.COMPLETED, output=transcript.text_of(tail))
            self._run_tools(messages, calls, pending, self.run.steps_used - 1, "tool_use")

        system = _agents_own("instructions", lambda: self.agent.system_prompt(ctx))
        specs = [t.spec for t in self.caller.tools.values()]
        while True:
            self._check_abort()
            self._check_budget()
            response = self._call_model(ModelRequest(system, messages, specs, self.run.id))
            self._model_step(messages, response)

    # -- start point -------------------------------------------------------------

    def _load(
        self,
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
        """The transcript to continue, the start messages not stored yet, pending answers, state."""
        stored = self.start
        state = stored.state
        if stored.damaged is not None:
            raise InvalidCheckpointError(f"cannot read {stored.damaged}")
        messages = stored.messages
        if messages:  # it started before: from its thread's runs as they were then
            self._check_thread_waited()
        unsaved: list[dict[str, Any]] = []
        if len(messages) < stored.base_messages:
            raise InvalidCheckpointError(
                f"the run continues {stored.base_messages} messages, "
                f"{len(messages)} of them are stored"
            )
        if len(messages) == stored.base_messages:  # none of its own yet: a new run
            if not messages and self.run.thread is not None:
                # Continue the thread's previous run: its transcript, read, not copied,
                # and the state it ended with.
                messages, state = self.store.start_thread(self.run.id, self.epoch, self.run.thread)
            if self.run.thread is not None:
                # (A state stored before the run saved anything is the one it inherited.)
                state = self._inherited(state)
            unsaved = [self.run.trigger.first_message()]
            messages = [*messages, *unsaved]
        else:
            beyond = len(messages) - stored.checkpoint_messages
            # Past the checkpoint there can only be the saved response of the step in
            # progress (with the start messages, if the first step is in progress).
            last = messages[-1]  # a row edited by hand may hold any JSON: validate says
            in_progress = isinstance(last, dict) and last.get("role") == "assistant"
            first_step = stored.checkpoint_step is None
            if not (beyond == 0 or (in_progress and (beyond == 1 or first_step))):
                raise InvalidCheckpointError(
                    f"{len(messages)} messages stored but the checkpoint holds "
                    f"{stored.checkpoint_messages}"
                )
        self._call_ids = transcript.validate(messages)
        return messages, unsaved, dict(stored.pending or {}), self._initial_state(state)

    def _check_thread_waited(self) -> None:
        """A run of its thread's own line goes on only while no later run of the thread
        has started: a retry and a later run's claim, at one moment, could both pass
        (each judged the other's row as it stood before), and the later run went on
        from the thread's runs before this one. Completing after it, this run would
        make the thread's next run skip it."""
        thread = self.run.thread
        if thread is None or self.run.concurrency_key != THREAD_KEY + thread:
            return  # a key of its own: its thread's runs may run at once anyway
        later = self.store.thread_went_on(self.run.id)
        if later is not None:
            raise InvalidCheckpointError(
                f"run {later} of its thread {thread!r} started while this one was retried,"
                " from the thread's runs before it: going on would fork the thread;"
                " dispatch to the thread again"
            )

    def _inherited(self, state: dict[str, Any] | None) -> dict[str, Any] | None:
        """A thread's state as this agent's state model takes it (fields it added get
        their defaults); None, for the model's default, if the model refuses it
        (another agent's, or an older model's) or the agent keeps no state."""
        model = self.agent.state
        if state is None or model is None:
            return None
        try:
            # From JSON, as the state is kept: a strict model's datetime is text there.
            taken = model.model_validate_json(
                json.dumps(state, ensure_ascii=False), by_name=True, by_alias=False
            )
        except ValidationError as exc:
            log.warning(
                "run %s: its thread's state does not fit agent %s's state model (%s);"
                " it starts from the model's default",
                self.run.id,
                self.agent.name,
                exc,
            )
            return None
        return taken.model_dump(mode="json")

    def _initial_state(self, stored: dict[str, Any] | None) -> dict[str, Any]:
        if stored is not None or self.agent.state is None:
            return dict(stored or {})
        try:
            return self.agent.state().model_dump(mode="json")
        except Exception:
            return {}

    def _assemble_tools(self, ctx: RunContext) -> dict[str, Tool]:
        tools: list[Tool] = []
        if self.agent.state is not None:
            tools += make_state_tools(self.agent.state, self.state)
        tools += _agents_own("tools", lambda: self.agent.tools_for(ctx))
        by_name: dict[str, Tool] = {}
        for t in tools:
            if t.name in by_name:
                raise ValueError(f"agent {self.agent.name!r} has two tools named {t.name!r}")
            by_name[t.name] = t
        return by_name

    # -- model steps ---------------------------------------------------------------

    def _check_budget(self) -> None:
        budget: Budget = self.run.budget or self.agent.budget
        if self.run.steps_used >= budget.max_steps:
            self._settle(
                RunStatus.FAILED,
                error=RunError(
                    code="step_budget_exceeded",
                    message=f"the run used all {budget.max_steps} model steps"
                    if self.run.steps_used == budget.max_steps
                    else f"the run used {self.run.steps_used} model steps, over its"
                    f" {budget.max_steps} (a retry's budget below its use)",
                ),
            )
        if budget.max_tokens is not None and self.run.usage.total_tokens >= budget.max_tokens:
            self._settle(
                RunStatus.FAILED,
                error=RunError(
                    code="token_budget_exceeded",
                    message=f"the run used {self.run.usage.total_tokens} of "
                    f"{budget.max_tokens} tokens",
                ),
            )

    def _call_model(self, request: ModelRequest) -> ModelResponse:
        self._step_started = utcnow()
        try:
            response = self.agent.model.complete(request, self.signal)
        except ModelAborted as exc:
            # What the provider counted before the call was stopped counts too.
            self._check_abort(getattr(exc, "usage", None))
            raise
        except ModelError as exc:
            self._fail_model(exception_text(exc, typed=False), exc.usage)
        except BaseException as exc:  # a model's SystemExit too, as _agents_own's
            if stops_the_task(exc):
                raise
            self._check_abort()
            self._fail_model(exception_text(exc))
        if self.reason is Abort.LEASE_LOST:
            raise LeaseLostError(self.run.id)
        if not isinstance(response, ModelResponse):  # a model of the team's own
            self._fail_model(
                f"malformed model reply: the model returned {type(response).__name__},"
                " not a ModelResponse"
            )
        problem = replies.malformed(response) or replies.uncountable(
            self.run.usage, replies.usage_of(response)
        )
        if problem:
            self._fail_model(f"malformed model reply: {problem}", replies.usage_of(response))
        return replies.with_new_ids(replies.without_blank_text(response), self._call_ids)

    def _fail_model(self, message: str, usage: Usage | None = None) -> None:
        """Fail the run with ``model_error``; the tokens of a refused reply still count,
        unless they are what is wrong with it."""
        if replies.uncountable(self.run.usage, usage):
            usage = None
        error = RunError(code="model_error", message=message)
        self._settle(RunStatus.FAILED, error=error, usage=usage)

    def _model_step(self, messages: list[dict[str, Any]], response: ModelResponse) -> None:
        now = utcnow()
        index = self.run.steps_used
        assistant = {"role": "assistant", "content": response.content}
        calls = response.tool_calls
        step = NewStep(
            kind="llm",
            name=response.model or self.agent.model.name,
            started_at=self._step_started,
            finished_at=now,
            output=_llm_output(response, calls),
        )
        write = Commit(
            steps=[step],
            messages=[*self.unsaved, assistant],
            usage=response.usage,
            model_calls=1,
        )
        if not calls:
            write.checkpoint = (index, response.stop_reason)
            write.state = self._state_to_save()
            write.status = RunStatus.COMPLETED
            # The run's output is a text column, which on Postgres cannot hold NUL
            # (the transcript keeps the answer exactly).
            write.output = response.text.replace("\x00", "\ufffd")
            write.release_claim = True
            write.pending = None
            self._commit_response(write, response)
            raise _Stop
        self._commit_response(write, response)
        self._call_ids.update(call["id"] for call in calls)
        self.unsaved = []
        messages.append(assistant)
        self._run_tools(messages, calls, {}, index, response.stop_reason)

    # -- tool steps ---------------------------------------------------------------

    def _run_tools(
        self,
        messages: list[dict[str, Any]],
        calls: list[dict[str, Any]],
        pending: dict[str, Any],
        index: int,
        finish_reason: str,
    ) -> None:
        """Run the step's calls in the model's order; pause on the first one awaiting
        approval, before any call after it runs."""
        tool_steps: list[NewStep] = []
        try:
            awaiting = self._call_in_turn(calls, pending, tool_steps, index, finish_reason)
        except _CallFailed as failed:
            # The calls done before it are kept as answers pending, as a drain keeps
            # them: a retry of the run does not make them again.
            steps = tool_steps + ([failed.step] if failed.step is not None else [])
            status = RunStatus.FAILED
            self._leave_step(steps, index, finish_reason, pending, status, error=failed.error)
            raise _Stop from None
        if awaiting is not None:
            self._pause(awaiting, pending, tool_steps, index, finish_reason)
        self._save_results(messages, calls, pending, tool_steps, index, finish_reason)

    def _call_in_turn(
        self,
        calls: list[dict[str, Any]],
        pending: dict[str, Any],
        tool_steps: list[NewStep],
        index: int,
        finish_reason: str,
    ) -> dict[str, Any] | None:
        """Make the step's calls not done yet, in order, up to the first one awaiting
        approval (which it returns)."""
        for call in calls:
            if not self._holds_lease():
                raise LeaseLostError(self.run.id)
            if self.signal.is_set() and self.reason is not None:
                # Cancelled, timed out or drained: no call starts after that. The
                # calls done so far are kept, so a recovery does not repeat them.
                self._stop_mid_step(pending, tool_steps, index, finish_reason)
            status = pending_.status(pending.get(call["id"]))
            if status == pending_.DONE:
                continue
            if status == pending_.NEEDS_APPROVAL or not self._call_one(call, pending, tool_steps):
                return call  # still unanswered, or now awaiting approval
        return None

    def _call_one(
        self, call: dict[str, Any], pending: dict[str, Any], tool_steps: list[NewStep]
    ) -> bool:
        """Make one call of the step, noting its result and its step row; False if it
        needs an approval first."""
        entry = pending.get(call["id"])
        approved = pending_.status(entry) == pending_.APPROVED
        again = approved and pending_.unknown(entry)
        if again:
            # A person approved calling it again after an unknown outcome: that
            # covers this attempt only. Used up before it starts, so that if its
            # outcome is unknown too, the person is asked again.
            pending[call["id"]] = pending_.approved(unknown=False)
            self._commit(Commit(pending=pending))
        started = utcnow()
        outcome = self._tool_call(call, approved, again, pending)
        if outcome is None:
            return False
        pending[call["id"]] = pending_.done(outcome.content, outcome.is_error)
        tool_steps.append(
            NewStep(
                kind="tool",
                name=call["name"],
                input=call["input"],
                output=outcome.output,
                error=outcome.error,
                started_at=started,
                finished_at=utcnow(),
            )
        )
        return True

    def _save_results(
        self,
        messages: list[dict[str, Any]],
        calls: list[dict[str, Any]],
        pending: dict[str, Any],
        tool_steps: list[NewStep],
        index: int,
        finish_reason: str,
    ) -> None:
        """End the step: its tool rows, the message answering every call, the checkpoint."""
        results = [
            transcript.tool_result(
                c["id"], pending[c["id"]]["content"], pending[c["id"]]["is_error"]
            )
            for c in calls
        ]
        message = transcript.results_message(results)
        # The new message must answer every call: checked per step, not per transcript.
        transcript.check_answered(calls, message, len(messages))
        self._commit(
            Commit(
                steps=tool_steps,
                messages=[message],
                checkpoint=(index, finish_reason),
                state=self._state_to_save(),
                pending=None,
                # Lost only with a crash of the database itself: then a recovery
                # repeats this step's tool calls (effect tools return their records),
                # never a model call, since every later write is durable and flushes it.
                durable=False,
            )
        )
        messages.append(message)

    def _tool_call(
        self,
        call: dict[str, Any],
        approved: bool,
        again: bool,
        pending: dict[str, Any],
    ) -> Outcome | None:
        """One call's outcome, or None when it must wait for an approval."""
        try:
            outcome = self.caller.call(call, self.run, approved, again)
        except (FatalToolError, EffectOutcomeUnknown) as exc:
            fatal = isinstance(exc, FatalToolError)
            said = exception_text(exc, typed=False)  # a tool raised it: str() may fail
            if not fatal:
                error = RunError(code="effect_outcome_unknown", message=said)
                raise _CallFailed(error, None) from None
            now = utcnow()
            step = NewStep(
                kind="tool",
                name=call["name"],
                input=call["input"],
                error=RunError(code="fatal_tool_error", message=said).model_dump(),
                started_at=now,
                finished_at=now,
            )
            error = RunError(code="fatal_tool_error", message=f"{call['name']}: {said}")
            raise _CallFailed(error, step) from None
        if isinstance(outcome, Wait):
            # Unknown: the answer approves calling it again.
            pending[call["id"]] = pending_.needs_approval(outcome.unknown)
            return None
        return outcome

    # -- approvals -------------------------------------------------------------------

    def _wait_point(self, call: dict[str, Any]) -> WaitPoint:
        return WaitPoint(
            approval_id=uuid.uuid4().hex,
            tool_name=call["name"],
            input=call["input"],
            expires_at=utcnow() + self.agent.approval_ttl,
            token_id=uuid.uuid4().hex,
            tool_call_id=call["id"],
        )

    def _pause(
        self,
        call: dict[str, Any],
        pending: dict[str, Any],
        tool_steps: list[NewStep],
        index: int,
        finish_reason: str,
    ) -> None:
        entry = pending[call["id"]]
        # A re-pause keeps the wait point (and so the token) it already announced.
        if "wait" in entry:
            wait = WaitPoint.model_validate(entry["wait"])
        else:
            wait = self._wait_point(call)
            pending[call["id"]] = {**entry, "wait": wait.model_dump(mode="json")}
        status = RunStatus.CANCELLED if self.reason is Abort.CANCEL else RunStatus.WAITING
        self._leave_step(
            tool_steps,
            index,
            finish_reason,
            pending,
            status,
            waiting=wait if status is RunStatus.WAITING else None,
        )
        # Unless it was cancelled as it paused, the engine calls the notifier once the
        # run's lease is let go.
        raise _Stop

    # -- writes --------------------------------------------------------------------------

    def _state_to_save(self) -> dict[str, Any] | None:
        return self.state.value if self.agent.state is not None else None

    def _commit_response(self, write: Commit, response: ModelResponse) -> None:
        """Save a model's reply; one no store can keep (text that is not UTF-8, JSON
        nested deeper than it encodes, too large a write) fails the run as the
        model's error, its tokens counted, before anything of it is written."""
        try:
            self._commit(write)
        except (ValueError, TypeError, RecursionError) as exc:  # UnicodeEncodeError too
            self._fail_model(
                f"malformed model reply: it cannot be stored ({exception_text(exc)})",
                response.usage,
            )

    def _commit(self, write: Commit) -> Run:
        if self.reason is Abort.LEASE_LOST:
            raise LeaseLostError(self.run.id)
        with self.engine.events.writing(self.run.id):
            committed = self.store.commit(self.run, self._guard, write)
            assert committed is not None  # a running guard raises instead
            self._saved = True
            self.run = committed.run
            self.engine.published(committed)
        return self.run

    def _check_abort(self, usage: Usage | None = None) -> None:
        if not self.signal.is_set() or self.reason is None:
            return
        if self.reason is Abort.LEASE_LOST:
            raise LeaseLostError(self.run.id)
        status, error = self._aborted_as()
        if replies.uncountable(self.run.usage, usage):
            usage = None
        self._settle(status, error=error, usage=usage)

    def _aborted_as(self) -> tuple[RunStatus, RunError | None]:
        """How an execution aborted for ``self.reason`` (not a lost lease) settles."""
        if self.reason is Abort.CANCEL:
            return RunStatus.CANCELLED, None
        if self.reason is Abort.DRAIN:
            return RunStatus.INTERRUPTED, None
        timeout = (self.run.budget or self.agent.budget).timeout_s
        return RunStatus.FAILED, RunError(
            code="timeout", message=f"the execution ran past {timeout} s"
        )

    def _stop_mid_step(
        self,
        pending: dict[str, Any],
        tool_steps: list[NewStep],
        index: int,
        finish_reason: str,
    ) -> None:
        """Settle an aborted execution between two tool calls of a step: the calls
        done are kept as answers pending (as a pause keeps them), the rest run when
        an interrupted run is recovered."""
        status, error = self._aborted_as()
        self._leave_step(tool_steps, index, finish_reason, pending, status, error=error)
        raise _Stop

    def _leave_step(
        self,
        tool_steps: list[NewStep],
        index: int,
        finish_reason: str,
        pending: dict[str, Any],
        status: RunStatus,
        *,
        waiting: WaitPoint | None = None,
        error: RunError | None = None,
    ) -> None:
        """Settle with the step unfinished: its tool steps so far, its answers pending
        (done, or awaiting approval), the checkpoint at the calls."""
        self._commit(
            Commit(
                steps=tool_steps,
                checkpoint=(index, finish_reason),
                state=self._state_to_save(),
                pending=pending,
                status=status,
                error=error,
                waiting=waiting,
                release_claim=True,
            )
        )
        self._cancel_if_asked()

    def _settle(
        self,
        status: RunStatus,
        *,
        output: str | None = None,
        error: RunError | None = None,
        steps: list[NewStep] | None = None,
        usage: Usage | None = None,
    ) -> None:
        self._commit(
            Commit(
                steps=steps or [],
                status=status,
                output=output,
                error=error,
                usage=usage,
                release_claim=True,
                waiting=None,
            )
        )
        self._cancel_if_asked()
        raise _Stop

    def _cancel_if_asked(self) -> None:
        """A cancel flagged while the run ran (its owner already stopping for another
        reason, or about to pause) that this execution left waiting or interrupted (a
        pause, a drain, a worker's time limit): cancelled now, as a waiting or
        interrupted run is at once. Else it waited for an approval nobody should give,
        or stayed interrupted until a recovery, and with no worker left, for good."""
        run = self.run
        if run.cancel_requested and run.status in (RunStatus.WAITING, RunStatus.INTERRUPTED):
            try:
                self.run = self.engine.cancel(run.id)
            except Exception as exc:  # a tick, or a recovery's execution, cancels it
                self.engine.report(exc)

    def _stopped(self, exc: Exception) -> None:
        """A worker's time limit stopped the execution, just before the pool kills the
        process. The run goes back whole, for recover(), as a drain leaves it (what its
        step in progress did is redone, as after a crash) if this execution saved
        anything. If it saved nothing, the next would be stopped at the same point
        (a model call or a tool longer than the limit), again after every recovery:
        the run fails with ``timeout`` instead."""
        if self._saved:
            log.warning(
                "run %s: %s stopped its execution; recover() resumes it",
                self.run.id,
                exception_text(exc),
            )
            status, error = RunStatus.INTERRUPTED, None
        else:
            status, error = (
                RunStatus.FAILED,
                RunError(
                    code="timeout",
                    message="the worker's time limit stopped the execution before it saved a step"
                    " (a model call or a tool took longer than task_time_limit allows)",
                ),
            )
        try:
            self._settle(status, error=error)
        except _Stop:
            pass
        except LeaseLostError:
            # Stopped just after a write that settled the run (before this execution
            # knew its result), or another engine has it: the run is as stored.
            with contextlib.suppress(Exception):
                self.run = self.store.get_run(self.run.id)
        except Exception as exc:
            self.engine.report(exc)

    def _settle_quietly(self, status: RunStatus, error: RunError) -> None:
        try:
            self._settle(status, error=error)
        except _Stop:
            pass
        except Exception as exc:
            self.engine.report(exc)


def _llm_output(response: ModelResponse, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """What an llm step row keeps: the message itself is stored once, in the transcript."""
    output: dict[str, Any] = {
        "finish_reason": response.stop_reason,
        # Zero counts are left out: this row is written on every step.
        "usage": {k: v for k, v in response.usage.model_dump().items() if v},
    }
    if response.text:
        output["text"] = response.text
    if calls:
        output["tool_calls"] = [{"id": c["id"], "name": c["name"]} for c in calls]
    return output
