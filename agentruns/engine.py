"""The engine (SPEC §4): dispatches runs, executes them under a lease, sweeps. Its
parts: answering approvals (``approvals.py``), putting lost runs back in line
(``recovery.py``) and queueing failed runs again (``retries.py``)."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, Unpack, overload

from agentruns import intake
from agentruns.agent import Agent
from agentruns.approvals import Approvals
from agentruns.errors import (
    LeaseLostError,
    NotifierError,
    exception_text,
    first_line,
    stops_the_task,
)
from agentruns.events import Events, EventType, Listener, RunUpdated, StepAppended
from agentruns.execution import Abort, Execution
from agentruns.keeper import LeaseKeeper
from agentruns.leases.base import Leases
from agentruns.leases.local import LocalLeases
from agentruns.leases.redis import RedisLeases
from agentruns.outages import is_outage
from agentruns.recovery import Recovery
from agentruns.retries import Retries
from agentruns.runs import (
    Budget,
    Checkpoint,
    Run,
    RunError,
    RunStatus,
    Step,
    TriggerEnvelope,
    is_storable_key,
)
from agentruns.schedulers.base import Scheduler
from agentruns.schedulers.local import LocalScheduler
from agentruns.settings import MAX_SECONDS, MAX_SLOTS
from agentruns.store.base import (
    Claimed,
    Commit,
    Committed,
    Guard,
    NewRun,
    Store,
)
from agentruns.store.schema import OWNER_LENGTH
from agentruns.store.sql import SqlStore

if TYPE_CHECKING:
    from agentruns.wiring import EngineOptions

log = logging.getLogger("agentruns")

# How long an execution waits for a free slot before looking again (drain, fallback).
_SLOT_WAIT_S = 0.2


# How long close() waits for notifier calls under way (a tick of any engine calls
# again those it leaves: their wait points are not marked announced).
NOTIFIERS_AT_CLOSE_S = 10.0
# Runs whose notifier failure was logged with its traceback, kept (see report).
_NOTIFIER_FAILURES_KEPT = 10_000


class Engine:
    """See SPEC §4. An engine never calls ``tick()`` or ``recover()`` by itself."""

    def __init__(
        self,
        store: Store | str,
        leases: Leases | None = None,
        scheduler: Scheduler | None = None,
        agents: Sequence[Agent] = (),
        secret: str | None = None,
        owner: str | None = None,
        slots: int = 8,
        lease_ttl: float = 30.0,
        requeue_after: float = 60.0,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        agents = list(agents)  # a generator, read once
        for agent in agents:  # before the store is opened
            _an_agent(agent)
        _check_options(slots, lease_ttl, requeue_after, owner)
        self.store: Store = SqlStore(store) if isinstance(store, str) else store
        try:
            self.store.check_schema()
        except BaseException:
            if isinstance(store, str):  # its own: nothing else would close its pool
                self.store.close()
            raise
        self.leases: Leases = leases if leases is not None else LocalLeases()
        self.scheduler: Scheduler = scheduler if scheduler is not None else LocalScheduler()
        self.secret = _signing_key(secret, self.leases)
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.slots = slots
        self.lease_ttl = lease_ttl
        self.requeue_after = requeue_after
        self._on_error = on_error
        self._notifier_failures: dict[str, None] = {}  # see _first_failure
        self._notifier_failures_lock = threading.Lock()
        self._agents: dict[str, Agent] = {}
        for agent in agents:
            self.register(agent)
        self.events = Events(self.report)
        self._keeper = LeaseKeeper(
            self.leases, self.store, self.owner, lease_ttl, self.report, self._give_up
        )
        self._calls = 0  # public calls in progress, executions among them (see idle)
        self._local = threading.local()  # executions on this thread's stack
        self._calls_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(slots)
        self._drain_lock = threading.Lock()
        self._draining = False
        self._closed = False
        self._shut = False  # close() has returned: nothing more may start
        # The scheduler's threads do not wait for notifiers: idle() does.
        self.scheduler.bind(partial(self.execute, wait_for_notifiers=False), slots)
        self._unsubscribe_aborts = self.leases.on_abort_request(self._abort_requested)
        self._closers: list[Callable[[], None]] = []
        self._approvals = Approvals(self)
        self._recovery = Recovery(self)
        self._retries = Retries(self)

    # -- configuration -----------------------------------------------------------

    def close_with(self, closer: Callable[[], None]) -> None:
        """Call ``closer`` when this engine closes (for listeners that hold resources)."""
        self._closers.append(closer)

    def register(self, agent: Agent) -> None:
        _an_agent(agent)
        if agent.name in self._agents and self._agents[agent.name] is not agent:
            raise ValueError(f"two agents are named {agent.name!r}")
        self._agents[agent.name] = agent

    @property
    def agents(self) -> dict[str, Agent]:
        return dict(self._agents)

    @classmethod
    def from_settings(cls, **overrides: Unpack[EngineOptions]) -> Engine:
        """An engine built from ``AGENTRUNS_*`` settings (see ``agentruns.settings``)."""
        from agentruns.wiring import engine_from_settings

        return engine_from_settings(**overrides)

    # -- producing runs ------------------------------------------------------------

    def dispatch(
        self,
        agent: str | Agent,
        trigger: TriggerEnvelope | dict[str, Any],
        *,
        idempotency_key: str | None = None,
        concurrency_key: str | None = None,
        thread: str | None = None,
        budget: Budget | dict[str, Any] | None = None,
        schedule: bool = True,
    ) -> Run:
        """Store a queued run and schedule it; the same idempotency key returns the same run.

        ``schedule=False`` leaves the scheduling to the caller.
        """
        new = intake.new_run(
            self._agents, agent, trigger, idempotency_key, concurrency_key, thread, budget
        )
        with self._calling():
            run = self._store_queued(new)
            if schedule and run.status is RunStatus.QUEUED:
                # Also for a duplicate: its first dispatcher may have died before scheduling.
                self.scheduler.schedule(run.id)
            return run

    def _store_queued(self, new: NewRun) -> Run:
        """``new`` stored queued; the run an idempotency key already names, if one does."""
        with self.events.writing(new.id):
            run, created = self.store.create_run(new)
            if created:
                self.events.run_updated(run)
        if not created:
            intake.warn_if_another(run, new)
        return run

    def dispatch_here(
        self,
        agent: str | Agent,
        trigger: TriggerEnvelope | dict[str, Any],
        *,
        idempotency_key: str | None = None,
        concurrency_key: str | None = None,
        thread: str | None = None,
        budget: Budget | dict[str, Any] | None = None,
        wait_for_notifiers: bool = True,
    ) -> Run:
        """Store a run and execute it in this process, now (what a Celery worker's
        dispatch task does): one message per run instead of a dispatch and an execute.
        ``wait_for_notifiers`` as for ``execute``.

        A run no concurrency key holds back is stored already claimed, in one
        write. Any other run (one with a key, a duplicate, or one that found no
        free slot soon enough) is stored queued and then executed here as
        ``execute`` would, if this engine can claim it. A run returned queued (its
        key is busy, this engine is draining or cannot reach Redis) is for the
        caller to schedule.
        """
        new = intake.new_run(
            self._agents, agent, trigger, idempotency_key, concurrency_key, thread, budget
        )
        wait = wait_for_notifiers and not self._inside_a_call()
        with self._calling():
            return self._dispatch_here(new, wait)

    def _dispatch_here(self, new: NewRun, wait: bool) -> Run:
        nested = self._inside_execution()
        if new.concurrency_key is None and (nested or self._slots.acquire(timeout=_SLOT_WAIT_S)):
            run: Run | None = None
            try:
                created = self._create_claimed(new)
                if created is not None:
                    with self._executing():
                        run = self._run_claimed(*created)
            finally:
                if not nested:
                    self._slots.release()
            if run is not None:
                self._after_run(run, wait)
                return self._as_stored_if_let_go(run)
        run = self._store_queued(new)
        if run.status is RunStatus.QUEUED and not self._draining:
            return self.execute(run.id, wait_for_notifiers=wait)
        return run

    def _create_claimed(self, new: NewRun) -> tuple[Claimed, float] | None:
        """``new`` stored claimed by this engine, with its lease, and when the lease was
        taken (``time.monotonic``); None if it cannot be."""
        try:
            leased = time.monotonic()
            if self._draining or not self.leases.acquire(new.id, self.owner, self.lease_ttl):
                return None
        except Exception as exc:
            self.report(exc)
            return None
        try:
            claimed = self.store.create_claimed(new, self.owner, self._keeper.expiry())
        except Exception:
            self._release_lease(new.id)
            raise
        if claimed is None:  # the idempotency key is taken: that run goes the usual way
            self._release_lease(new.id)
            return None
        return claimed, leased

    # -- executing -------------------------------------------------------------------

    def execute(self, run_id: str, *, wait_for_notifiers: bool = True) -> Run:
        """One execution of a queued run; does nothing if another engine has it.

        The notifier of a run that paused is called on a thread of the engine's own,
        after the run's lease and slot are let go; this returns once it has, unless
        not ``wait_for_notifiers`` (a worker's task: a slow webhook then holds none of
        its pool's threads) or it is called from inside a call of this engine."""
        # No read first: the claim is the check (a run that is not queued, or not
        # there, costs a lease round trip and a claim that matches nothing).
        run_id = intake.run_id(run_id)
        wait = wait_for_notifiers and not self._inside_a_call()
        with self._calling(new_work=False):
            # One called from inside an execution (a listener's, a tool's) runs on that
            # execution's thread and slot: waiting for a slot of its own could wait for
            # itself.
            nested = self._inside_execution()
            while not nested and not self._slots.acquire(timeout=_SLOT_WAIT_S):
                if self._draining:
                    return self.store.get_run(run_id)
            try:
                with self._executing():
                    run, ran = self._execute_claimed(run_id)
            finally:
                if not nested:
                    self._slots.release()
            if ran:
                self._after_run(run, wait)
                run = self._as_stored_if_let_go(run)
            return run

    def _as_stored_if_let_go(self, run: Run) -> Run:
        """An execution's run, or, if it let the run go running (a lost lease, an
        outage), the run as it is stored: another engine may have taken it on, or
        settled it, meanwhile."""
        if run.status is RunStatus.RUNNING:
            with contextlib.suppress(Exception):
                return self.store.get_run(run.id)
        return run

    def _inside_a_call(self) -> bool:
        """Is this thread inside a call of this engine's (a tool, listener or notifier
        of its)? Waiting there for a notifier could wait for a thread it holds."""
        return getattr(self._local, "calls", 0) > 0

    def _inside_execution(self) -> bool:
        """Is this thread inside one of this engine's executions (a tool, a listener)?"""
        return getattr(self._local, "executing", 0) > 0

    @contextlib.contextmanager
    def _executing(self) -> Iterator[None]:
        self._local.executing = getattr(self._local, "executing", 0) + 1
        try:
            yield
        finally:
            self._local.executing -= 1

    def _not_inside_a_call(self, call: str) -> None:
        """``idle`` and ``close`` wait for every ``execute`` and ``dispatch_here`` in
        progress, with what follows them (the notifier): not from inside one."""
        if self._inside_a_call():
            raise RuntimeError(
                f"{call} cannot be called from inside one of this engine's executions "
                "(a tool, listener or notifier): it would wait for that execution, which "
                "waits for it"
            )

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """This thread runs code the engine calls (a notifier on a thread of its own):
        ``idle`` and ``close`` from it are refused, as from a tool, and what it calls
        on the engine is a call inside one, which a close under way lets through."""
        self._local.calls = getattr(self._local, "calls", 0) + 1
        try:
            yield
        finally:
            self._local.calls -= 1

    @contextlib.contextmanager
    def _calling(self, new_work: bool = True) -> Iterator[None]:
        """A call in progress, for ``idle`` and ``close``: an ``execute`` or
        ``dispatch_here`` from before its claim until after what follows a run's
        release (its notifier, the next run of its key); any other call that writes
        runs, until its events are delivered and its run is scheduled.

        ``new_work`` is refused once ``close()`` has begun (counted first, so that
        ``close()`` either waits for it or it sees the close): the scheduler would
        drop what it schedules, a run left for ``recover()``, and an answered
        approval spent for nothing. A call inside one in progress (a tool's, a
        listener's, a notifier's), which ``close()`` waits for, still runs; and an
        ``execute`` during the close does nothing, as during a drain."""
        with self._calls_lock:
            self._calls += 1
        nested = getattr(self._local, "calls", 0)
        self._local.calls = nested + 1
        try:
            if self._shut or (new_work and self._closed and not nested):
                raise RuntimeError("this engine is closed: build another one")
            yield
        finally:
            self._local.calls -= 1
            with self._calls_lock:
                self._calls -= 1

    def _execute_claimed(self, run_id: str) -> tuple[Run, bool]:
        """The run after this engine claimed and executed it (and True), or as it is
        when it could not be claimed (and False)."""
        try:
            leased = time.monotonic()
            # Not while an execution of the run that lost its lease is still here (stuck
            # on a silent Postgres): as it ends, it would let go of the lease and the
            # keeping of the new one, both under this engine's name. recover() sends
            # the run again later, to this engine or another.
            if (
                self._draining
                or self._keeper.keeps(run_id)
                or not self.leases.acquire(run_id, self.owner, self.lease_ttl)
            ):
                return self.store.get_run(run_id), False
        except Exception as exc:
            self.report(exc)
            return self.store.get_run(run_id), False
        try:
            # A write that committed before this claim (an answer's requeue) has its
            # events queued before this run's "running".
            with self.events.writing(run_id):
                claimed = self.store.claim(run_id, self.owner, self._keeper.expiry())
        except Exception:
            self._release_lease(run_id)
            raise
        if claimed is None:
            self._release_lease(run_id)
            run = self.store.get_run(run_id)
            if run.status is RunStatus.QUEUED and run.concurrency_key is not None:
                self._nudge_if_claimable(run_id)
            return run, False
        return self._run_claimed(claimed, leased), True

    def _nudge_if_claimable(self, run_id: str) -> None:
        """A keyed run's claim judged its key as it stood when the claim began: an
        older run that finished meanwhile still held it back, and the execution its
        finish scheduled found this lease held and did nothing. Looked at again now,
        with the lease let go: if the run can be claimed, it is scheduled again."""
        try:
            if self.store.claimable(run_id):
                self.scheduler.schedule(run_id)
        except Exception as exc:
            self.report(exc)

    def _run_claimed(self, claimed: Claimed, leased: float) -> Run:
        """Execute a run this engine claimed and holds the lease of (taken at ``leased``,
        by ``time.monotonic``); then let both go."""
        run = claimed.run
        run_id = run.id
        dying = False
        try:
            agent = self._agents.get(run.agent)
            if agent is None:
                self.events.run_updated(run)
                error = RunError(code="unknown_agent", message=f"no agent named {run.agent!r}")
                run = self._fail(run, claimed.epoch, error)
            else:
                execution = Execution(self, agent, claimed)
                budget = run.budget or agent.budget
                # Kept before anyone hears it runs: a cancel from then on reaches it.
                held = self._keeper.keep(execution, budget.timeout_s, leased)
                if self._draining:  # claimed as a drain began: it stops at once
                    execution.abort(Abort.DRAIN)
                try:
                    if not held:  # the claim came too late to be kept: nothing is done
                        raise LeaseLostError(run_id)
                    self.events.run_updated(run)
                    run = execution.execute()
                finally:
                    self._keeper.release(run_id)
        except Exception as exc:
            self.report(exc)
            if run.status is RunStatus.RUNNING and not self._leaves_run_to_recovery(exc):
                # Failing before its execution could: it would fail again on every
                # recovery, so the run fails now instead of being left running.
                error = RunError(code="internal_error", message=exception_text(exc))
                with contextlib.suppress(Exception):
                    run = self._fail(run, claimed.epoch, error)
        except BaseException:
            # The process stops under the execution (a prefork child's SIGTERM, as a
            # hard time limit sends it before SIGKILL; a cold shutdown): as a crash,
            # the loss of the run's step counts, and a step that kills its process
            # again and again is held back longer each time.
            dying = True
            raise
        finally:
            if run.status is RunStatus.RUNNING and not dying:  # let go by a live process
                self._give_up(run_id, claimed.epoch)
            self._release_lease(run_id)
        return run

    def _give_up(self, run_id: str, epoch: int) -> None:
        """Note that this process let its claim of the run go (an outage, a lost lease,
        a shutdown): recover() does not count it as a loss of the run's step."""
        try:
            self.leases.give_up(run_id, epoch, _GIVEN_UP_S)
        except Exception as exc:
            self.report(exc)  # the loss is counted: at worst the run waits a little

    def _after_run(self, run: Run, wait: bool) -> None:
        """What follows an execution, once its slot is free for another: announcing
        its wait (a notifier may take long), scheduling its key's next run."""
        if run.status is RunStatus.FAILED and run.error is not None:
            # Said where an operator looks: the task's own line says only "failed".
            log.warning("run %s failed: %s: %s", run.id, run.error.code, run.error.message[:500])
        key = run.concurrency_key
        # An interrupted run goes first again once recover() requeues it. The next
        # run is scheduled first: a slow notifier holds back no run of the key.
        if key is not None and run.status not in (RunStatus.RUNNING, RunStatus.INTERRUPTED):
            self._schedule_next(key)
        if run.status in (RunStatus.WAITING, RunStatus.FAILED):
            self._look_again(run.id, wait)

    def _look_again(self, run_id: str, wait: bool) -> None:
        """After a run paused or failed and its lease is let go. An answer or a retry
        (a listener's, or a quick person's) that came while this engine still held the
        lease scheduled an execution that found the lease held and did nothing: a run
        queued again is scheduled again. One still waiting has its wait announced
        (``wait``: before this returns)."""
        try:
            current = self.store.get_run(run_id)
            if current.status is RunStatus.QUEUED:
                self.scheduler.schedule(run_id)
            elif current.status is RunStatus.WAITING:
                self._approvals.announce(current, wait)
        except Exception as exc:
            self.report(exc)

    def _release_lease(self, run_id: str) -> None:
        try:
            self.leases.release(run_id, self.owner)
        except Exception as exc:
            self.report(exc)

    def _leaves_run_to_recovery(self, exc: Exception) -> bool:
        return (
            isinstance(exc, LeaseLostError)
            or self.is_infrastructure_error(exc)
            or stops_the_task(exc)
        )

    def _fail(self, run: Run, epoch: int, error: RunError) -> Run:
        """Settle a run this engine claimed ``failed``, outside any execution."""
        with self.events.writing(run.id):
            committed = self.store.commit(
                run,
                Guard(status=RunStatus.RUNNING, epoch=epoch),
                Commit(status=RunStatus.FAILED, error=error, release_claim=True),
            )
            assert committed is not None
            self.published(committed)
        return committed.run

    def _schedule_next(self, key: str) -> None:
        try:
            next_id = self.store.next_queued(key)
            if next_id is not None:
                self.scheduler.schedule(next_id)
        except Exception as exc:
            self.report(exc)

    def _abort_requested(self, run_id: str) -> None:
        self._keeper.abort(run_id, Abort.CANCEL)

    # -- called by executions ----------------------------------------------------------

    def published(self, committed: Committed) -> None:
        """Deliver the events of a committed write (its steps are built only for a
        listener)."""
        if self.events.wants("step.appended"):
            self.events.steps_appended(committed.steps)
        self.events.run_updated(committed.run)

    def report(self, exc: Exception, *, what: str | None = None) -> None:
        """Give ``exc`` to ``on_error``, or log it; ``what`` says, in the log, what it
        stopped (a bare outage line did not say which run, nor what became of it)."""
        if self._on_error is None:
            if isinstance(exc, LeaseLostError):
                log.warning("%s", exc)
            elif self.is_infrastructure_error(exc):
                # An outage the README says what becomes of: one line, not a traceback
                # for each of a worker's runs.
                log.warning("agentruns: %s%s", f"{what}: " if what else "", first_line(exc))
            elif isinstance(exc, NotifierError) and not self._first_failure(exc.run_id):
                # tick calls it again every 5 s: its traceback once, then a line a call
                # (17,000 tracebacks a day for one waiting run).
                log.error("agentruns: %s (again)", first_line(exc, typed=False))
            else:
                log.error("agentruns error", exc_info=exc)
            return
        try:
            self._on_error(exc)
        except Exception:
            log.exception("on_error raised")

    def _first_failure(self, run_id: str) -> bool:
        """Whether this is the first notifier failure of the run logged here (of the
        newest few thousand runs whose notifiers failed)."""
        with self._notifier_failures_lock:
            if run_id in self._notifier_failures:
                return False
            self._notifier_failures[run_id] = None
            if len(self._notifier_failures) > _NOTIFIER_FAILURES_KEPT:
                del self._notifier_failures[next(iter(self._notifier_failures))]
            return True

    @staticmethod
    def is_infrastructure_error(exc: Exception) -> bool:
        return is_outage(exc)

    # -- approvals ---------------------------------------------------------------------------

    def resume(self, token: str, *, approved: bool, reason: str | None = None) -> Run:
        """Answer the approval a token stands for, once; the run is queued again."""
        with self._calling():
            return self._approvals.resume(token, approved=approved, reason=reason)

    def approval_token(self, run_id: str, *, approval_id: str | None = None) -> str:
        """Mint the current resume token of a waiting run again (for an operator). With
        ``approval_id`` (the ``waiting.approval_id`` the operator looked at), refused
        (``InvalidTokenError``, ``stale``) if the run waits on another approval now:
        the one looked at was answered meanwhile, and the answer is not the new one's."""
        if approval_id is not None and not isinstance(approval_id, str):
            raise TypeError(f"approval_id must be text, not {type(approval_id).__name__}")
        return self._approvals.token(self.store.get_run(intake.run_id(run_id)), approval_id)

    # -- control -------------------------------------------------------------------------------

    def cancel(self, run_id: str) -> Run:
        run_id = intake.run_id(run_id)
        with self._calling():
            with self.events.writing(run_id):
                run = self.store.request_cancel(run_id)
                if run.status is RunStatus.CANCELLED:
                    self.events.run_updated(run)
            if run.status is RunStatus.RUNNING:
                try:
                    self.leases.request_abort(run_id)
                except Exception as exc:
                    self.report(exc)  # the owner still sees cancel_requested on its next renewal
            elif run.status is RunStatus.CANCELLED and run.concurrency_key is not None:
                self._schedule_next(run.concurrency_key)
            return run

    def retry(
        self,
        run_id: str,
        *,
        budget: Budget | dict[str, Any] | None = None,
        request_id: str | None = None,
    ) -> Run:
        """Queue a failed run again, to go on from its latest checkpoint: its saved model
        responses and tool results are kept and not repeated, and effect tools return
        their recorded results. ``budget`` replaces the limits it names in the budget the
        run had (a run failed on its budget fails on it again unless it grows). A run
        queued already (retried by another caller, or by this call's first try, whose
        reply was lost) is scheduled again: a nudge, which its claim decides. Raises
        ``NotRetryableError`` for a run in any other status, for a queued one whose
        budget is not the one ``budget`` would give it, or if a later run of its thread
        has started.

        ``request_id`` names the request (the ``agentruns.retry`` task gives its
        message's id): a request answered already, within a week (it queued the run,
        nudged it, or was refused), is not again, whatever became of the run since (it
        is returned as it is, and nudged if queued). A message delivered again, after
        its worker died before it acked or through an outage after a first try that
        went through, would otherwise queue again a run that failed once more since,
        nobody asking."""
        run_id = intake.run_id(run_id)
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be text, not {type(request_id).__name__}")
        with self._calling():
            return self._retries.retry(run_id, budget, request_id)

    def tick(self, *, wait_for_notifiers: bool = True) -> None:
        """Deny approvals past their expiry; re-send notifications that did not go
        through (on the engine's own threads: returns once they are made, unless not
        ``wait_for_notifiers``, as beat's ``tick`` task does: a webhook that hangs
        then holds no worker thread, nor piles ticks up)."""
        wait = wait_for_notifiers and not self._inside_a_call()
        with self._calling():
            self._approvals.tick(wait)

    def recover(self) -> list[str]:
        """Requeue interrupted runs, runs whose owner died, and queued runs whose nudge
        was lost (``recovery.py``). The ids requeued."""
        with self._calling():
            return self._recovery.recover()

    def hold(self, run_id: str) -> tuple[int, datetime | None]:
        """How many of the run's executions were lost with their workers in a row at its
        step, and when ``recover`` may requeue it if it is held back for them now."""
        return self._recovery.hold(intake.run_id(run_id))

    def drain(self, timeout: float | None = None) -> None:
        """Stop claiming; abort in-flight runs, which settle ``interrupted`` and release claims."""
        self._draining = True
        self._keeper.abort_all(Abort.DRAIN)
        deadline = None if timeout is None else time.monotonic() + timeout
        # Every execution holds a slot from before it looks at the drain flag until it
        # has settled: once all slots are free here, none is left, also none that was
        # claiming its run as the drain began (it aborts itself once kept). Called from
        # inside an execution (a tool), that one's slot is never free before this
        # returns: it is aborted, and it settles once its tool returns.
        others = self.slots - (1 if self._inside_execution() else 0)
        # One drain takes the slots at a time: two would split them, and each would
        # wait out its timeout with the other's half.
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._drain_lock.acquire(timeout=-1 if left is None else left):
            return
        taken = 0
        try:
            while taken < others:
                wait = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
                if wait <= 0:
                    return
                if self._slots.acquire(timeout=wait):
                    taken += 1
        finally:
            for _ in range(taken):
                self._slots.release()
            self._drain_lock.release()

    def idle(self, timeout: float | None = None, *, notifiers: bool = True) -> bool:
        """True once nothing runs here, nothing more can start, and events were delivered
        (and the notifier calls asked for returned, unless not ``notifiers``)."""
        self._not_inside_a_call("idle()")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if (
                not self._calls
                and not self._keeper.busy()
                and self.scheduler.outstanding() == 0
                and not self.events.busy()
                and not (notifiers and self._approvals.busy())
            ):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def close(self, *, notifiers_timeout: float = NOTIFIERS_AT_CLOSE_S) -> None:
        """Drain, then release the pools and threads; the notifier calls asked for are
        given ``notifiers_timeout`` seconds to return, and a call left under way then is
        made again by a later ``tick`` (the run is not marked notified)."""
        self._not_inside_a_call("close()")
        if self._closed:
            return
        self._closed = True
        self.drain()
        # What follows an execution runs after its slot is free: the pools it uses
        # are not closed under it, nor under the notifier calls it asked for.
        while self._calls:
            time.sleep(0.005)
        self._approvals.close(notifiers_timeout)
        self._keeper.stop()
        self._unsubscribe_aborts()
        for closer in self._closers:
            try:
                closer()
            except Exception as exc:
                self.report(exc)
        self.scheduler.close()
        self.leases.close()
        self.store.close()
        self._shut = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reads ----------------------------------------------------------------------------------

    def get_run(self, run_id: str) -> Run:
        return self.store.get_run(intake.run_id(run_id))

    def list_runs(
        self, status: RunStatus | str | None = None, agent: str | None = None, limit: int = 100
    ) -> list[Run]:
        intake.limit(limit)
        if agent is not None and not isinstance(agent, str):
            raise TypeError(f"agent must be an agent's name (str), not {agent!r}")
        if agent is not None and not is_storable_key(agent):
            return []  # no agent can have such a name
        return self.store.list_runs(RunStatus(status) if status else None, agent, limit)

    def steps(self, run_id: str) -> list[Step]:
        return self.store.steps(intake.run_id(run_id))

    def checkpoint(self, run_id: str) -> Checkpoint | None:
        return self.store.checkpoint(intake.run_id(run_id))

    @overload
    def on(
        self, event: Literal["run.updated"], listener: Callable[[RunUpdated], None]
    ) -> Callable[[], None]: ...
    @overload
    def on(
        self, event: Literal["step.appended"], listener: Callable[[StepAppended], None]
    ) -> Callable[[], None]: ...
    @overload
    def on(self, event: EventType, listener: Listener) -> Callable[[], None]: ...
    def on(self, event: EventType, listener: Callable[[Any], None]) -> Callable[[], None]:
        """Call ``listener`` with each ``event`` after its write commits; the unsubscribe."""
        return self.events.on(event, listener)


def _check_options(slots: Any, lease_ttl: Any, requeue_after: Any, owner: Any) -> None:
    """``ValueError`` for an engine's option it cannot work with, said before anything
    is opened."""
    if not _whole(slots) or not 1 <= slots <= MAX_SLOTS:
        raise ValueError(f"slots must be a whole number from 1 to {MAX_SLOTS}, not {slots!r}")
    times = (lease_ttl, requeue_after)
    if not all(_number(t) and 0 < t <= MAX_SECONDS for t in times):
        raise ValueError(
            f"lease_ttl and requeue_after must be seconds from 0 to {MAX_SECONDS}"
            f" (not {lease_ttl!r}, {requeue_after!r})"
        )
    if owner is not None and not (
        isinstance(owner, str) and 0 < len(owner) <= OWNER_LENGTH and is_storable_key(owner)
    ):
        # Postgres refused every claim of such an owner (SQLite took them), and each
        # dispatched run stayed queued, said only as "execution failed" in the log.
        raise ValueError(
            f"owner must be UTF-8 text of 1 to {OWNER_LENGTH} characters without NUL,"
            f" not {owner!r}"[:300]
        )


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _signing_key(secret: str | None, leases: Leases) -> str:
    """The key resume tokens are signed with: the engine's secret, or, with none and
    in-process leases (the demo, tests), a random one good in this process only."""
    if secret is not None and not (isinstance(secret, str) and is_storable_key(secret)):
        # Bytes were taken, and every approval then waited with no token to answer it.
        raise TypeError(
            f"secret must be text (str), not {type(secret).__name__}: the same text"
            " on every process (AGENTRUNS_SECRET); decode or base64 a key held as bytes"
        )
    if secret == "":
        # An empty HMAC key signs tokens anyone who reads a waiting run can forge.
        raise ValueError("secret must not be empty (None: a random one for this process)")
    if secret is None and isinstance(leases, RedisLeases):
        # Runs move between the processes that share the leases: a token one of
        # them mints must pass in another (SPEC: required outside the demo).
        raise ValueError(
            "secret is required with RedisLeases: every process that shares the leases"
            " signs and checks resume tokens with the same one"
        )
    if secret is None:
        warnings.warn(
            "Engine has no secret: resume tokens will only be valid in this process",
            stacklevel=3,  # the caller of Engine()
        )
        secret = secrets.token_urlsafe(32)
    return secret


# How long the note that a live process gave a run's claim up is kept for recover().
_GIVEN_UP_S = 3600.0


def _an_agent(agent: Any) -> None:
    if not isinstance(agent, Agent):
        raise TypeError(f"an engine's agents are Agent objects, not {agent!r}")
