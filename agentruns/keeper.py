"""The executions one engine is running, kept honest: leases renewed, timeouts and aborts applied.

One thread per engine watches every held lease. Every ``lease_ttl/3`` it has
the lease renewed on a small pool (in Redis, then the claim's expiry in the
database, fenced by the epoch), so a renewal stalled on Redis delays no one's
timeout. A renewal that fails, or none that succeeds before the lease could
expire, aborts that execution as lost. A failed renewal is tried again at its
time while the execution ends (a tool call in flight may not heed the abort, and
the lease keeps another engine from making it again meanwhile); once a whole TTL
passed with none that went through (Postgres cut off from this engine alone, the
execution stuck on a statement to a silent server), the lease is renewed no more,
for it to lapse and another engine to take the run over, and this live process
notes at once that it let the claim go, for ``recover`` not to take it for a
crash. A claim whose run was asked to cancel
aborts it as cancelled (the fallback when the cancel's pub/sub message was
missed). With leases only this process sees (``LocalLeases``), a cancel asked
in another process has no message to come by: the keeper looks for cancels in
the store every ``CANCEL_LOOK_S``, one read for all its runs.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta

from agentruns.execution import Abort, Execution
from agentruns.leases.base import Leases
from agentruns.runs import utcnow
from agentruns.store.base import Store

log = logging.getLogger("agentruns")


class _Kept:
    def __init__(self, execution: Execution, ttl: float, timeout_s: float | None, leased: float):
        self.execution = execution
        now = time.monotonic()
        self.next_renewal = leased + ttl / 3
        self.deadline = now + timeout_s if timeout_s else None
        # Until when the lease is known to be held: when it was taken (or last renewed,
        # the renewal's start) plus a TTL.
        self.held_until = leased + ttl
        self.renewing = False
        # Its lease could not be kept: it is renewed no more (see _lose).
        self.lost = False
        self.failed = False  # a renewal failed (said once)


class LeaseKeeper:
    CANCEL_LOOK_S = 0.5

    def __init__(
        self,
        leases: Leases,
        store: Store,
        owner: str,
        lease_ttl: float,
        report: Callable[[Exception], None],
        give_up: Callable[[str, int], None],
    ) -> None:
        self._leases = leases
        self._store = store
        self._owner = owner
        self._ttl = lease_ttl
        self._report = report
        self._give_up = give_up
        self._kept: dict[str, _Kept] = {}
        # Aborts asked for runs not kept (yet): one may come between a claim and keep().
        self._early: dict[str, tuple[Abort, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Renewals wait on Redis and Postgres; timeouts must not wait for them.
        self._renewals = ThreadPoolExecutor(max_workers=4, thread_name_prefix="agentruns-renew")
        # Notes of claims let go, apart: the renewals' threads may all be stuck on a
        # silent Postgres, the very case the notes are for (they go to the leases).
        self._notes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentruns-given-up")
        self._look_for_cancels = bool(getattr(leases, "process_local", False))
        self._looking = False

    def expiry(self) -> datetime:
        return utcnow() + timedelta(seconds=self._ttl)

    def keep(self, execution: Execution, timeout_s: float | None, leased: float) -> bool:
        """Keep the execution's lease and claim, the lease taken at ``leased`` (by
        ``time.monotonic``). False if they cannot be kept: a claim that waited long
        (behind a lock, for a connection) was written with an expiry that has passed
        or soon will, and another engine's ``recover`` may take the run over at any
        moment. Such a claim is renewed now, before the execution does anything."""
        item = _Kept(execution, self._ttl, timeout_s, leased)
        execution.lease_ends = lambda: item.held_until
        late = time.monotonic() - leased > self._ttl / 3
        item.renewing = late  # renewed here, not by the watcher meanwhile
        with self._lock:
            self._kept[execution.run_id] = item
            early = self._early.pop(execution.run_id, None)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="agentruns-leases", daemon=True
                )
                self._thread.start()
        if early is not None and time.monotonic() - early[1] < self._ttl:
            execution.abort(early[0])
        if late:
            self._renew(item)
            return execution.reason is not Abort.LEASE_LOST
        return True

    def release(self, run_id: str) -> None:
        with self._lock:
            self._kept.pop(run_id, None)

    def abort(self, run_id: str, reason: Abort) -> None:
        """Abort the run's execution here; one that starts within a lease TTL too."""
        now = time.monotonic()
        with self._lock:
            kept = self._kept.get(run_id)
            if kept is None:
                # Every engine hears every cancel: remember them only for a while.
                # Oldest first, so forgetting costs the ones it forgets, not a
                # copy of all of them per cancel (20k in a TTL took 11 s).
                self._early.pop(run_id, None)
                self._early[run_id] = (reason, now)
                while True:
                    oldest = next(iter(self._early))
                    if now - self._early[oldest][1] < self._ttl:
                        break
                    del self._early[oldest]
        if kept is not None:
            kept.execution.abort(reason)

    def abort_all(self, reason: Abort) -> None:
        with self._lock:
            kept = list(self._kept.values())
        for item in kept:
            item.execution.abort(reason)

    def keeps(self, run_id: str) -> bool:
        """Is an execution of the run still here (one that lost its lease, stuck)?"""
        with self._lock:
            return run_id in self._kept

    def busy(self) -> bool:
        with self._lock:
            return bool(self._kept)

    def stop(self) -> None:
        self._stop.set()
        self._renewals.shutdown(wait=False)
        self._notes.shutdown(wait=False)

    def _watch(self) -> None:
        interval = min(0.1, self._ttl / 10)
        next_look = 0.0
        while not self._stop.wait(interval):
            now = time.monotonic()
            with self._lock:
                kept = list(self._kept.values())
            if self._look_for_cancels and kept and now >= next_look and not self._looking:
                next_look = now + self.CANCEL_LOOK_S
                self._looking = True
                try:
                    self._renewals.submit(self._cancels, kept)
                except RuntimeError:  # stopped meanwhile
                    return
            for item in kept:
                if item.deadline is not None and now >= item.deadline:
                    item.execution.abort(Abort.TIMEOUT)
                if now >= item.held_until and not item.lost:
                    # No renewal made it in time: another engine may hold the run now.
                    self._lose(item, noted_later=True)
                if now >= item.next_renewal and not item.renewing and not item.lost:
                    item.next_renewal = now + self._ttl / 3
                    item.renewing = True
                    try:
                        self._renewals.submit(self._renew, item)
                    except RuntimeError:  # stopped meanwhile
                        return

    def _cancels(self, kept: list[_Kept]) -> None:
        try:
            asked = self._store.cancels_requested([item.execution.run_id for item in kept])
        except Exception:
            # The renewals report what keeps the store away, and find the cancels later.
            log.debug("looking for cancels failed", exc_info=True)
            return
        finally:
            self._looking = False
        for item in kept:
            if item.execution.run_id in asked:
                item.execution.abort(Abort.CANCEL)

    def _renew(self, item: _Kept) -> None:
        """Renew the lease, then the claim. One that is no longer this engine's is lost
        for good. One that failed (a blip of Redis or Postgres) aborts the execution,
        and is renewed again at its time: the execution may not stop at once (a tool
        call in flight that does not heed its signal), and its lease keeps another
        engine from making that call again meanwhile. Renewed no more once a whole
        TTL passed without a renewal that went through (``_watch``)."""
        execution = item.execution
        started = time.monotonic()
        try:
            held = self._leases.renew(execution.run_id, self._owner, self._ttl)
            cancel = held and self._store.renew_claim(
                execution.run_id, execution.epoch, self.expiry()
            )
        except Exception as exc:
            if not item.failed:  # one line per execution, not one per renewal
                self._report(exc)
            item.failed = True
            execution.abort(Abort.LEASE_LOST)
            return
        finally:
            item.renewing = False
        if not held or cancel is None:
            self._lose(item)
            return
        item.held_until = started + self._ttl
        if cancel:
            execution.abort(Abort.CANCEL)

    def _lose(self, item: _Kept, noted_later: bool = False) -> None:
        """The lease could not be kept: the execution stops, and this live process notes
        that it let the claim go (a lost lease is no crash of the run's step), on the
        notes' own thread if ``noted_later`` (the watcher waits on no one)."""
        if item.lost:
            return
        item.lost = True
        execution = item.execution
        execution.abort(Abort.LEASE_LOST)
        if noted_later:
            # Stopped meanwhile: the execution notes it as it ends.
            with contextlib.suppress(RuntimeError):
                self._notes.submit(self._note_given_up, execution)
        else:
            self._note_given_up(execution)

    def _note_given_up(self, execution: Execution) -> None:
        try:
            self._give_up(execution.run_id, execution.epoch)
        except Exception as exc:
            self._report(exc)
