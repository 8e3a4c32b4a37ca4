"""Runs waiting on an approval: answering them (``resume``), expiring them and
announcing them (the agent's notifier, which ``tick`` retries until it returns).

The tokens themselves are ``tokens.py``'s; only their ids are stored.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from agentruns import pending as pending_
from agentruns import tokens
from agentruns.agent import Agent
from agentruns.announcer import Announcer
from agentruns.errors import (
    AgentrunsError,
    InvalidAnswerError,
    InvalidTokenError,
    NotifierError,
    UnknownAgentError,
)
from agentruns.events import Events
from agentruns.leases.base import Leases
from agentruns.runs import Run, RunError, RunStatus, WaitPoint, is_utf8, utcnow
from agentruns.schedulers.base import Scheduler
from agentruns.store.base import Commit, Committed, Guard, NewStep, Store, WaitRef

# The shortest time the lock around a notifier call is taken for (it is renewed).
_NOTIFY_LOCK_S = 30.0


log = logging.getLogger("agentruns")


class Host(Protocol):
    """What approvals need from the engine whose runs they are."""

    store: Store
    leases: Leases
    scheduler: Scheduler
    events: Events
    secret: str
    owner: str
    lease_ttl: float

    @property
    def agents(self) -> dict[str, Agent]: ...

    def published(self, committed: Committed) -> None: ...

    def inside(self) -> contextlib.AbstractContextManager[None]: ...

    def report(self, exc: Exception, *, what: str | None = None) -> None: ...

    def cancel(self, run_id: str) -> Run: ...


# Waiting runs read in full at a time (each holds its tool's input): one read,
# not one per run, and a bounded amount of it in memory.
_READ_AT_ONCE = 100


@dataclass(frozen=True)
class _Seen:
    """What ``tick`` read of a wait point, and need not read again before it expires."""

    expires_at: datetime
    notified: bool


class Approvals:
    """An engine's approvals (SPEC §4, "Approvals")."""

    def __init__(self, engine: Host) -> None:
        self.engine = engine
        self._seen: dict[str, _Seen] = {}  # by token id: what tick read of wait points
        self._seen_lock = threading.Lock()
        self._announcer = Announcer(self._notify_inside, engine.report)

    def announce(self, run: Run, wait: bool) -> None:
        """Call the notifier of the run's wait point soon, on a thread of the engine's
        (``wait``: before this returns)."""
        asked = self._ask(run)
        if wait and asked is not None:
            self._announcer.wait_for({asked})

    def _ask(self, run: Run) -> str | None:
        agent = self.engine.agents.get(run.agent)
        if agent is None or agent.notifier is None:
            return None
        return self._announcer.ask(run)

    def busy(self) -> bool:
        """Whether a notifier call is asked for or under way."""
        return self._announcer.busy()

    def close(self, timeout: float) -> None:
        self._announcer.close(timeout)

    def _notify_inside(self, run: Run) -> None:
        with self.engine.inside():
            self.notify(run)

    def resume(self, token: str, *, approved: bool, reason: str | None = None) -> Run:
        """Answer the approval a token stands for, once; the run is queued again."""
        check_answer(approved, reason)
        engine = self.engine
        claims = tokens.verify(engine.secret, token)
        try:
            run = engine.store.get_run(claims.run_id)
        except AgentrunsError:
            raise InvalidTokenError("stale", "the token's run does not exist") from None
        if run.status is not RunStatus.WAITING or not tokens.matches(claims, run.id, run.waiting):
            raise InvalidTokenError("stale", "the run is not waiting on this token")
        if run.waiting is not None and run.waiting.expires_at <= utcnow():
            raise InvalidTokenError("expired")  # tick has not answered it yet
        if run.agent not in engine.agents:
            # As dispatch: an engine that could not run the answered run refuses, and
            # the token stays good for one that can.
            raise UnknownAgentError(run.agent)
        return self._answer(run, approved=approved, reason=reason)

    def _answer(self, run: Run, *, approved: bool, reason: str | None) -> Run:
        engine = self.engine
        wait = run.waiting
        assert wait is not None and wait.tool_call_id is not None
        stored = engine.store.pending(run.id)
        problem = pending_.damaged(stored)
        if problem is not None:
            return self._fail_damaged(run, f"run {run.id}'s row: its pending {problem}")
        pending = dict(stored or {})
        asked_again = pending_.unknown(pending.get(wait.tool_call_id))
        denied = None if approved else _denial(reason, asked_again)
        if denied is not None and asked_again:
            record = engine.store.effects(run.id).get(wait.tool_call_id)
            if record is None:
                # Its earlier attempt said it failed since (a paused worker's call, which
                # raised FatalToolError when it went on, and deleted its intent): the call
                # was not made, and the model is told so, not "it may have happened".
                denied = _denial(reason, asked_again=False)
            elif record.done:
                # Its earlier attempt's result was recorded since (a paused worker's,
                # when it went on): no call is made either way, and the model gets that
                # result.
                denied = None
        if denied is None:
            pending[wait.tool_call_id] = pending_.approved(asked_again)
        else:
            pending[wait.tool_call_id] = pending_.done(denied, is_error=True)
        agent = engine.agents.get(run.agent)
        steps = _answer_steps(wait, agent, approved, reason, denied)
        with engine.events.writing(run.id):
            committed = engine.store.commit(
                run,
                Guard(status=RunStatus.WAITING, token_id=wait.token_id),
                # The same step index: the answer joins the checkpoint of the step that asked.
                Commit(
                    steps=steps,
                    pending=pending,
                    checkpoint=(run.steps_used - 1, "tool_use"),
                    status=RunStatus.QUEUED,
                    waiting=None,
                ),
            )
            if committed is None:
                raise InvalidTokenError("stale", "the approval was answered or cancelled meanwhile")
            engine.published(committed)
        engine.scheduler.schedule(run.id)
        return committed.run

    def _fail_damaged(self, run: Run, damaged: str) -> Run:
        """Fail a waiting run whose checkpoint cannot be read (edited by hand): no answer
        can be joined to it, and an execution would fail it the same way."""
        engine = self.engine
        assert run.waiting is not None
        error = RunError(code="invalid_checkpoint", message=f"cannot read {damaged}")
        with engine.events.writing(run.id):
            committed = engine.store.commit(
                run,
                Guard(status=RunStatus.WAITING, token_id=run.waiting.token_id),
                Commit(status=RunStatus.FAILED, error=error, waiting=None),
            )
            if committed is None:
                raise InvalidTokenError("stale", "the approval was answered or cancelled meanwhile")
            engine.published(committed)
        log.warning("run %s failed: invalid_checkpoint: %s", run.id, error.message)
        return committed.run

    def token(self, run: Run, approval_id: str | None = None) -> str:
        """The current resume token of a waiting run, minted again (for an operator);
        refused as ``stale`` unless it waits on ``approval_id``, if given: the one the
        operator looked at was answered meanwhile, and the run asks another."""
        if run.status is not RunStatus.WAITING or run.waiting is None:
            raise AgentrunsError(f"run {run.id} is {run.status.value}, not waiting on an approval")
        wait = run.waiting
        if approval_id is not None and wait.approval_id != approval_id:
            raise InvalidTokenError(
                "stale",
                f"run {run.id} waits on approval {wait.approval_id} now (of a"
                f" {wait.tool_name} call), not on {approval_id} (answered meanwhile, or"
                f" not its id): look at the run again (agentruns show {run.id})",
            )
        return tokens.mint(self.engine.secret, run.id, wait)

    def tick(self, wait: bool) -> None:
        """Deny approvals past their expiry; re-send notifications that did not go through
        (``wait``: before this returns).

        A wait point is read in full (its tool's input with it) only when there may
        be something to do: the first time this engine meets it, once it expires,
        and while it is not announced and its agent has a notifier. What was read is
        kept by token id: a new wait point has a new one, and an announced one stays
        announced."""
        engine = self.engine
        now = utcnow()
        waiting = engine.store.waiting_runs()
        with self._seen_lock:
            # What no run waits on any more is forgotten.
            self._seen = seen = {
                w.token_id: self._seen[w.token_id] for w in waiting if w.token_id in self._seen
            }
        known = [(ref, seen.get(ref.token_id or "")) for ref in waiting]
        to_read = [ref.run_id for ref, seen_of in known if self._may_be_due(ref, seen_of, now)]
        asked: set[str] = set()
        for start in range(0, len(to_read), _READ_AT_ONCE):
            try:
                runs = engine.store.get_runs(to_read[start : start + _READ_AT_ONCE])
            except Exception as exc:
                engine.report(exc)
                continue
            for run in runs:
                token_id = self._tick_one(run, now)
                if token_id is not None:
                    asked.add(token_id)
        if wait:
            self._announcer.wait_for(asked)

    def _may_be_due(self, ref: WaitRef, known: _Seen | None, now: datetime) -> bool:
        """Might tick have something to do for the run? Not if what it read of its wait
        point says there is nothing before it expires: most of them."""
        if known is None or known.expires_at <= now or ref.cancel_requested:
            return True
        agent = self.engine.agents.get(ref.agent)
        return not known.notified and agent is not None and agent.notifier is not None

    def _tick_one(self, run: Run, now: datetime) -> str | None:
        """Expire or announce one waiting run, read in full; its trouble is reported,
        and holds up no other run. The token id of a wait point it asked to announce."""
        wait = run.waiting
        if run.status is not RunStatus.WAITING or wait is None:
            return None  # answered meanwhile, or a wait point damaged by hand
        if run.cancel_requested:
            # Flagged as it paused, by a process that died before it cancelled the
            # run (execution.py): nobody is asked to approve a cancelled run.
            try:
                self.engine.cancel(run.id)
            except Exception as exc:
                self.engine.report(exc)
            return None
        with self._seen_lock:
            self._seen[wait.token_id] = _Seen(wait.expires_at, wait.notified_at is not None)
        try:
            if wait.expires_at <= now:
                # InvalidTokenError: someone answered it meanwhile.
                with contextlib.suppress(InvalidTokenError):
                    self._answer(run, approved=False, reason="approval expired")
            elif wait.notified_at is None:
                return self._ask(run)
        except Exception as exc:
            self.engine.report(exc)
        return None

    def notify(self, run: Run) -> None:
        """Call the agent's notifier for the run's wait point; mark it notified if it returns."""
        engine = self.engine
        agent = engine.agents.get(run.agent)
        wait = run.waiting
        if agent is None or agent.notifier is None or wait is None or wait.notified_at:
            return
        # One notifier call at a time per wait point, across every engine and tick.
        lock_id = f"notify:{wait.token_id}"
        ttl = max(engine.lease_ttl, _NOTIFY_LOCK_S)
        try:
            if not engine.leases.acquire(lock_id, engine.owner, ttl):
                return
        except Exception as exc:
            engine.report(exc)
            return
        try:
            current = engine.store.get_run(run.id)
            if current.waiting is None or current.waiting.token_id != wait.token_id:
                return
            if current.waiting.notified_at is not None or current.cancel_requested:
                return
            token = tokens.mint(engine.secret, run.id, wait)
            try:
                # Held for as long as the notifier takes (a slow webhook): a tick
                # meanwhile would otherwise call it again.
                with self._holding(lock_id, ttl):
                    agent.notifier(current, current.waiting, token)
            except Exception as exc:
                # Its own kind: a webhook's OSError is not the store or Redis going away.
                raise NotifierError(run.id, exc) from exc
            notified = current.waiting.model_copy(update={"notified_at": utcnow()})
            with engine.events.writing(run.id):
                committed = engine.store.commit(
                    current,
                    Guard(status=RunStatus.WAITING, token_id=wait.token_id),
                    Commit(waiting=notified),
                )
                if committed is not None:
                    engine.events.run_updated(committed.run)
        except Exception as exc:
            engine.report(exc)
        finally:
            try:
                engine.leases.release(lock_id, engine.owner)
            except Exception as exc:
                engine.report(exc)

    @contextlib.contextmanager
    def _holding(self, lock_id: str, ttl: float) -> Iterator[None]:
        """Renew a lease the engine holds every third of ``ttl`` until the block ends."""
        engine = self.engine
        done = threading.Event()

        def renew() -> None:
            while not done.wait(ttl / 3):
                try:
                    if not engine.leases.renew(lock_id, engine.owner, ttl):
                        return
                except Exception as exc:
                    engine.report(exc)

        renewer = threading.Thread(target=renew, name="agentruns-notify-lock", daemon=True)
        renewer.start()
        try:
            yield
        finally:
            done.set()
            renewer.join()


def _denial(reason: str | None, asked_again: bool) -> str:
    """What the model is told of a denied call (the call's result, as an error)."""
    said = reason or "no reason given"
    if asked_again:
        # Asked to call it again: the model must not take it for never made.
        return (
            "The call was not made again: a crash left the outcome of an earlier"
            f" attempt unknown (it may have happened), and calling it again was"
            f" denied: {said}"
        )
    return f"The call was denied: {said}"


def _answer_steps(
    wait: WaitPoint, agent: Agent | None, approved: bool, reason: str | None, denied: str | None
) -> list[NewStep]:
    """The ``wait`` step recording the answer, spanning the wait (from the pause to
    now), and for a denial the tool row of the call's result."""
    now = utcnow()
    asked = wait.expires_at - agent.approval_ttl if agent is not None else now
    steps = [
        NewStep(
            kind="wait",
            name=wait.tool_name,
            input=wait.input,
            output={"approval_id": wait.approval_id, "approved": approved, "reason": reason},
            started_at=min(asked, now),
            finished_at=now,
        )
    ]
    if denied is not None:
        # The model gets the denial as the call's result: a tool row records it, as
        # it does every other result of a step (an approved call's, once it runs).
        error = {"code": "approval_denied", "message": denied}
        steps.append(
            NewStep(
                kind="tool",
                name=wait.tool_name,
                input=wait.input,
                error=error,
                started_at=now,
                finished_at=now,
            )
        )
    return steps


def check_answer(approved: Any, reason: Any) -> None:
    """``InvalidAnswerError`` for an answer no approval could take."""
    if not isinstance(approved, bool):
        raise InvalidAnswerError(f"approved must be True or False, not {approved!r}")
    if reason is not None and not (isinstance(reason, str) and is_utf8(reason)):
        raise InvalidAnswerError(f"reason must be UTF-8 text or None, not {reason!r}")
