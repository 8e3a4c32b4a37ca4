"""``recover()``: runs whose execution ended without settling them, put back in line.

Interrupted runs (a drain), running runs whose claim expired with no process holding
their lease (their worker died, or a live one let them go), and queued runs whose
nudge was lost are requeued and scheduled. A run whose executions were lost with
their workers again and again at one step (a step that kills its worker) waits
longer before each requeue.
"""

from __future__ import annotations

import hashlib
import logging
from datetime import datetime, timedelta
from typing import Protocol

from agentruns.events import Events
from agentruns.leases.base import Leases
from agentruns.runs import RunStatus, utcnow
from agentruns.schedulers.base import Scheduler
from agentruns.store.base import RunRef, Store

log = logging.getLogger("agentruns")

# The longest a run lost again and again at one step waits before its next requeue.
MOST_HELD_BACK_S = 3600.0


class Host(Protocol):
    """What recovery needs from the engine whose runs it requeues."""

    store: Store
    leases: Leases
    scheduler: Scheduler
    events: Events
    lease_ttl: float
    requeue_after: float

    def report(self, exc: Exception, *, what: str | None = None) -> None: ...


class Recovery:
    def __init__(self, host: Host) -> None:
        self.host = host

    def recover(self) -> list[str]:
        """Requeue and schedule what can be; the ids requeued."""
        host = self.host
        now = utcnow()
        requeued: list[str] = []
        # While nudges wait for a worker (a backlog), a queued run's is most likely
        # among them: another would only lengthen the line, on every sweep, by every
        # run in it. Its nudge counts as lost once the line is gone.
        behind = bool(host.scheduler.waiting())
        for ref in host.store.sweep_candidates(now - timedelta(seconds=host.requeue_after)):
            if behind and ref.status is RunStatus.QUEUED:
                continue
            try:
                if self._requeue(ref, now):
                    requeued.append(ref.id)
                    host.scheduler.schedule(ref.id)
            except Exception as exc:
                host.report(exc)
        # The counts of losses of runs that got on or settled since (a table that
        # only recover writes to, and only for lost executions).
        host.store.forget_losses()
        host.store.forget_retries()  # requests no message brings again this late
        return requeued

    def _requeue(self, ref: RunRef, now: datetime) -> bool:
        if ref.status is RunStatus.RUNNING:
            lost = self._lost(ref, now)
            if lost is None:
                return False
        elif ref.status is RunStatus.QUEUED and self.host.leases.holder(ref.id) is not None:
            return False  # an execution is claiming it right now
        else:
            lost = False
        with self.host.events.writing(ref.id):
            requeued = self.host.store.requeue(ref, count_loss=lost)
            if requeued is None:
                return False
            self.host.events.run_updated(requeued)
        if lost and ref.losses:
            log.warning(
                "run %s requeued after its execution was lost with its worker %d times in a"
                " row at step %d. If its step kills the worker that runs it, `agentruns"
                " cancel` it; its waits before a requeue double, up to an hour",
                ref.id,
                ref.losses + 1,
                ref.step,
            )
        else:
            log.info("run %s requeued: %s", ref.id, _why_requeued(ref, lost))
        return True

    def _lost(self, ref: RunRef, now: datetime) -> bool | None:
        """Of a running run: None if it is not to be requeued now (its claim lives, or
        it waits out a hold), else whether its execution was lost with its worker."""
        host = self.host
        if ref.claim_expires_at is not None and ref.claim_expires_at > now:
            # A live claim, unless its owner's clock is ahead of ours: no owner
            # renews a claim further than its TTL ahead. With shared leases the
            # lease then says (a dead owner's claim would hold the run back by
            # the skew); without, the claim is all there is to go by.
            ahead = ref.claim_expires_at > now + timedelta(seconds=host.lease_ttl)
            if not ahead or getattr(host.leases, "process_local", False):
                return None
        if host.leases.holder(ref.id) is not None:
            return None
        # Its execution ended with its process (a live one notes what it gives up).
        lost = not host.leases.given_up(ref.id, ref.epoch)
        ends = self._hold_ends(ref) if lost else None
        if ends is not None and now < ends:
            return None  # lost again at the step it was lost at: it waits its turn
        return lost

    def hold(self, run_id: str) -> tuple[int, datetime | None]:
        """How many of a run's executions were lost with their workers in a row at its
        step, and, if it is running unclaimed and held back for them, when ``recover``
        may requeue it."""
        ref = self.host.store.run_ref(run_id)
        if ref is None:
            return 0, None
        if ref.status is not RunStatus.RUNNING or self.host.leases.given_up(ref.id, ref.epoch):
            return ref.losses, None
        return ref.losses, self._hold_ends(ref)

    def _hold_ends(self, ref: RunRef) -> datetime | None:
        """When a running run lost with its worker may be requeued, if it is held back
        (lost before at this step; a cancel is not held back: the run settles once an
        execution claims it)."""
        if not ref.losses or ref.cancel_requested:
            return None
        lost_at = ref.claim_expires_at or ref.updated_at
        return held_until(ref.id, lost_at, ref.losses, self.host.requeue_after)


def _why_requeued(ref: RunRef, lost: bool) -> str:
    """Why recover requeued a run, for the operator reading a worker's log."""
    if ref.status is RunStatus.INTERRUPTED:
        return "it was interrupted (a drain, or a worker's time limit)"
    if ref.status is RunStatus.QUEUED:
        since = ref.updated_at.isoformat(timespec="seconds")
        return f"queued since {since} with no execution under way (its message was lost)"
    if lost:
        return f"its execution was lost with its worker at step {ref.step} (its claim expired)"
    return f"its worker let it go at step {ref.step} (an outage, a lost lease or a shutdown)"


def held_until(run_id: str, lost_at: datetime, losses: int, requeue_after: float) -> datetime:
    """When ``recover`` may requeue a run lost ``losses`` times in a row at its step, the
    last time at ``lost_at`` (its dead worker's claim expiry)."""
    return lost_at + timedelta(seconds=held_back(run_id, losses, requeue_after))


def held_back(run_id: str, losses: int, requeue_after: float) -> float:
    """How long after its claim expired a run whose executions were lost with their
    workers ``losses`` times in a row at its step waits before its next requeue: doubling
    from ``requeue_after`` on, at most an hour, and spread by the run (half to one
    and a half times that). A step that kills its worker would otherwise do so at
    every sweep, and take every run that worker held with it each time; runs lost
    beside it in the same deaths are requeued at other moments, so they get on."""
    if losses < 1:
        return 0.0
    digest = hashlib.blake2b(f"{run_id}:{losses}".encode(), digest_size=8).digest()
    spread = 0.5 + int.from_bytes(digest, "big") / 2**64
    doubled = requeue_after * 2.0 ** min(losses - 1, 64)  # 2.0 ** 1024 overflows
    return float(min(MOST_HELD_BACK_S, doubled) * spread)
