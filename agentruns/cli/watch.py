"""``agentruns watch``: follow runs live, printing status changes and new steps.

With Redis configured, engines publish event summaries (``agentruns.broadcast``)
and the watcher reads the store as soon as one arrives; without it, it polls.
The store stays the truth either way: events only say when to look.
"""

from __future__ import annotations

import json
import select
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import Any, TextIO

import redis

from agentruns.broadcast import subscribe
from agentruns.cli import render
from agentruns.cli.session import Session
from agentruns.engine import Engine
from agentruns.errors import RunNotFoundError, first_line
from agentruns.outages import DATABASE_OUTAGE
from agentruns.runs import Run, RunStatus, Step, utcnow
from agentruns.store.base import RunHead

ACTIVE = [RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING, RunStatus.INTERRUPTED]
# The newest runs of each active status a look reads (besides the newest 100 runs): a
# change of another run is read when an event names it.
WINDOW = 1000
# Runs a look reads again by id, at most: those the watcher holds unsettled that settled
# outside its window (the rest wait for the next look).
REREAD = 1000
# Step counts kept of runs forgotten settled, at most: a retry brings such a run back.
REMEMBERED = 10_000


class _Follower:
    def __init__(self, session: Session, engine: Engine, history: bool) -> None:
        self.session = session
        self.engine = engine
        self.history = history  # print the steps a run already had when first seen
        self.updated: dict[str, datetime] = {}
        self.status: dict[str, RunStatus] = {}
        self.steps: dict[str, int] = {}  # how many of each run's steps are shown (or old)
        self.held: list[str] | None = None  # lines kept back while set
        self.started: dict[str, datetime] = {}  # runs an event said started, and when
        # Runs events named since the last look, oldest first: read by id if the look
        # lacks them (a run outside its window: one of over WINDOW waiting, say).
        self.named: dict[str, None] = {}
        # The step counts of runs forgotten settled, oldest first (see _old_steps).
        self.forgotten: OrderedDict[str, int] = OrderedDict()
        self.began = utcnow()

    def emit(self, line: str) -> None:
        if self.held is not None:
            self.held.append(line)
        else:
            self.session.emit(line)

    def poll(self, looked: Sequence[Run | RunHead], baseline: bool) -> None:
        """Show what changed in the runs of a look. A run is read in full only when its
        status line is shown (its wait point, say, may hold a tool's large input), all
        such runs in one read; of its steps, only those not shown yet are read."""
        read: set[str] = set()  # the names events gave that this look reads
        if not baseline:
            looked = [*looked, *self._left(looked, read)]
        changed = [
            head
            for head in sorted(looked, key=lambda r: r.created_at)
            if self.updated.get(head.id) != head.updated_at
        ]
        wanted = [h.id for h in changed if not isinstance(h, Run) and self._shows(h, baseline)]
        full = {run.id: run for run in self._get_runs(wanted)}
        for head in changed:
            if baseline and head.status.is_final and not self.history:
                self.updated[head.id] = head.updated_at
                self.status[head.id] = head.status
                continue
            try:
                if self._shows(head, baseline):
                    run = head if isinstance(head, Run) else full.get(head.id)
                    if run is None:
                        continue  # deleted by hand since the look
                    self._show(run, head, baseline)
                else:  # the status shown still holds: only its new steps, if any
                    steps = self._unshown(head.id)  # read first: see _show
                    self.updated[head.id] = head.updated_at
                    self._show_steps(head.id, steps)
            except RunNotFoundError:
                continue  # deleted by hand since the look
        # Forgotten once shown: a read that failed (the database went away), of the
        # runs or of their steps, leaves them named for the next look.
        for run_id in read:
            self.named.pop(run_id, None)
        self._forget(looked)

    def _shows(self, head: Run | RunHead, baseline: bool) -> bool:
        """Whether the look shows the run's status line (so reads it in full)."""
        if baseline and head.status.is_final and not self.history:
            return False
        return (
            head.id not in self.status
            or self.status[head.id] != head.status
            or head.id in self.started
        )

    def _get_runs(self, run_ids: list[str]) -> list[Run]:
        """The runs, in reads of a few hundred each (SQLite takes that many values)."""
        return [
            run
            for at in range(0, len(run_ids), 500)
            for run in self.engine.store.get_runs(run_ids[at : at + 500])
        ]

    def _unshown(self, run_id: str) -> list[Step]:
        return self.engine.store.steps(run_id, self.steps.get(run_id, 0))

    def _show(self, run: Run, head: Run | RunHead, baseline: bool) -> None:
        # Read before anything is noted: a read that fails (the database went away)
        # leaves the run to be shown by the next look, not taken as shown.
        old: int | None = None  # of a run first seen, the steps not to show
        if run.id in self.steps or self.history:
            steps = self._unshown(run.id)
        elif baseline:  # (one settled when first seen too): its steps came before
            old = head.step_count if isinstance(head, RunHead) else len(self.engine.steps(run.id))
            steps = []
        else:
            old, steps = self._old_steps(run.id)
        self.updated[run.id] = run.updated_at
        if old is not None:
            self.steps[run.id] = old
            self.forgotten.pop(run.id, None)
        new = run.id not in self.status
        changed = new or self.status[run.id] != run.status
        started = self.started.pop(run.id, None)
        # An execution's steps come after it starts running and before it settles.
        if changed and run.status is RunStatus.RUNNING:
            self._run(run)
        elif started is not None and changed and self.status.get(run.id) != RunStatus.RUNNING:
            # It started and settled between two looks: an event said it ran.
            self._run(_as_running(run, started))
        self._show_steps(run.id, steps)
        if changed and run.status is not RunStatus.RUNNING:
            self._run(run)
        self.status[run.id] = run.status

    def _show_steps(self, run_id: str, steps: list[Step]) -> None:
        shown = self.steps.get(run_id, 0)
        for step in steps:
            if step.index >= shown:
                self._step(step)
                shown = step.index + 1
        self.steps[run_id] = shown

    def _left(self, looked: Sequence[Run | RunHead], read: set[str]) -> list[Run]:
        """The runs held unsettled that a look lacks, and those events named, read again
        by id: a look holds only the newest runs and the active ones, so a run that
        settled once newer runs had pushed it out of the window is shown settled only by
        this read (and ``--until-final`` waited for it for ever), and a change of a run
        outside the window (cancelling the oldest of 2,000 waiting) only if an event
        named it. A held run this read lacks was deleted; a named one is another
        deployment's. The names it reads, or finds in the look, are added to ``read``;
        those the read has no room for wait for the next look."""
        shown = {run.id for run in looked}
        held = [r for r, status in self.status.items() if not status.is_final]
        lost = [r for r in held if r not in shown][:REREAD]
        lost_set = set(lost)
        named = [r for r in self.named if r not in shown and r not in lost_set]
        taken = named[: max(0, REREAD - len(lost))]
        again = self._get_runs([*lost, *taken])
        read.update(taken, (r for r in self.named if r in shown or r in lost_set))
        found = {run.id for run in again}
        for run_id in lost:
            if run_id not in found:
                self._drop(run_id)
        return again

    def _old_steps(self, run_id: str) -> tuple[int, list[Step]]:
        """How many of the steps of a run first seen after the baseline are not new, and
        those after them: a run forgotten settled and back (retried) shows only the
        steps after those it had; one that settled before the watch began, only those
        after it began."""
        count = self.forgotten.get(run_id)
        if count is not None:
            return count, self.engine.store.steps(run_id, count)
        steps = self.engine.steps(run_id)
        old = next((i for i, step in enumerate(steps) if step.finished_at > self.began), len(steps))
        return old, steps[old:]

    def _forget(self, runs: Sequence[Run | RunHead]) -> None:
        """Keep only what a later look can need (a watcher may run for months): a run
        that left the watched window settled changes again only if retried (its step
        count is kept a while for that), and a start heard of a run the look did not
        show is another deployment's."""
        shown = {run.id for run in runs}
        for run_id in [r for r, status in self.status.items() if status.is_final]:
            if run_id not in shown:
                count = self.steps.get(run_id)
                self._drop(run_id)
                if count is not None:
                    self.forgotten[run_id] = count
                    if len(self.forgotten) > REMEMBERED:
                        self.forgotten.popitem(last=False)
        for run_id in [r for r in self.started if r not in shown]:
            del self.started[run_id]

    def _drop(self, run_id: str) -> None:
        self.status.pop(run_id, None)
        self.updated.pop(run_id, None)
        self.steps.pop(run_id, None)

    def heard(self, event: dict[str, object]) -> None:
        """An event published by an engine: note when a run started running, unless
        the store has shown a later state of the run already (events can come late:
        the engine publishes one after each step, and a look may be ahead of them)."""
        run_id = event.get("run_id")
        if not isinstance(run_id, str):
            return
        self.named.pop(run_id, None)  # (newest last)
        self.named[run_id] = None
        if len(self.named) > REREAD:
            del self.named[next(iter(self.named))]
        if event.get("status") != RunStatus.RUNNING.value:
            return
        at = _when(event.get("updated_at"))
        shown = self.updated.get(run_id)
        if at is not None and shown is not None and at <= shown:
            return
        self.started.setdefault(run_id, at or utcnow())

    def settled(self) -> bool:
        return all(status.is_final for status in self.status.values())

    def _run(self, run: Run) -> None:
        if self.session.as_json:
            self._json({"event": "run.updated", "run": render.run_json(run)})
        else:
            self.emit(f"{render.clock(run.updated_at)}  {render.run_line(run)}")

    def _step(self, step: Step) -> None:
        if self.session.as_json:
            self._json({"event": "step.appended", "step": step.model_dump(mode="json")})
        else:
            at = render.clock(step.finished_at)
            self.emit(f"{at}    {step.run_id[:8]} {render.step_line(step)}")

    def _json(self, value: Any) -> None:
        self.emit(json.dumps(value, ensure_ascii=False))


def _when(value: object) -> datetime | None:
    """An event's ``updated_at`` (engines before it was published send none)."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def _as_running(run: Run, since: datetime) -> Run:
    """The run as it was while running, for a start seen only as an event."""
    return run.model_copy(
        update={
            "status": RunStatus.RUNNING,
            "updated_at": since,
            "waiting": None,
            "error": None,
            "output": None,
            "finished_at": None,
        }
    )


def _runs(engine: Engine, run_id: str | None) -> list[Run | RunHead]:
    """A look: the newest runs and every active one, as heads (read in full only if shown)."""
    if run_id is not None:
        return [engine.get_run(run_id)]
    found: dict[str, Run | RunHead] = {r.id: r for r in engine.store.run_heads(limit=100)}
    for status in ACTIVE:
        found.update((r.id, r) for r in engine.store.run_heads(status, limit=WINDOW))
    return list(found.values())


def watch(session: Session, *, run_id: str | None, until_final: bool, interval: float) -> int:
    engine = session.engine(read_only=True)
    follower = _Follower(session, engine, history=run_id is not None)
    # What is there already comes first, then the promise: anything after it is new.
    follower.held = []
    follower.poll(_runs(engine, run_id), baseline=True)
    held, follower.held = follower.held, None
    for line in held:
        session.emit(line)
    if not session.as_json:
        target = f"run {run_id}" if run_id else "all runs"
        stop = "it settles" if until_final else "Ctrl-C"
        every = f"every {interval:g}s"
        how = f"as events arrive and {every}" if session.settings.redis_url else every
        session.emit(f"watching {target} {how} until {stop}")
    lost = _Lost()
    try:
        for events in _wakeups(session, interval):
            if _reader_gone(session.out):
                raise BrokenPipeError  # as a write would meet it: the command ends, exit 0
            # (An empty list: subscribed again, events may have been missed: a look.)
            if events:
                # One look for all the events that came together, and none for
                # another run's (or another deployment's) only.
                mine = [e for e in events if run_id is None or e.get("run_id") == run_id]
                if not mine:
                    continue
                for event in mine:
                    follower.heard(event)
            if not lost.look(lambda: follower.poll(_runs(engine, run_id), baseline=False)):
                continue
            if until_final and follower.settled():
                break
    except KeyboardInterrupt:
        pass
    return 0


def _reader_gone(out: TextIO) -> bool:
    """Whether ``out`` is a pipe whose reader went away (``agentruns watch | head -1``):
    a watch that has nothing more to print (its run settled) never met the broken
    pipe a write would, and never ended."""
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's StringIO)
        return False
    poller = select.poll()
    poller.register(fd, 0)  # a pipe's reader gone is POLLERR, a terminal's POLLHUP: always said
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


class _Lost:
    """A watch outlives the database going away for a while (a restart, a dropped
    connection): a look that fails is said once, on stderr, and made again at the
    next wake-up; where it worked, it was the first read that ended the watch."""

    def __init__(self) -> None:
        self.since: float | None = None

    def look(self, poll: Callable[[], None]) -> bool:
        try:
            poll()
        except DATABASE_OUTAGE as exc:  # not any OSError: stdout's BrokenPipeError ends it
            if self.since is None:
                self.since = time.monotonic()
                _note(f"cannot read the database ({first_line(exc, typed=False)}); trying again")
            return False
        if self.since is not None:
            _note(f"reading the database again, after {time.monotonic() - self.since:.0f}s")
            self.since = None
        return True


def _note(text: str) -> None:
    print(f"agentruns: {text}", file=sys.stderr, flush=True)


def _wakeups(session: Session, interval: float) -> Iterator[list[dict[str, object]] | None]:
    """When to look again: on the events published over Redis, else every ``interval``.
    Without Redis's events (it went away), the store is looked at on that clock, and
    Redis asked again at each look: a watch once left without them stayed so."""
    redis_url = session.settings.redis_url
    lost = False
    while True:
        if redis_url:
            try:
                for events in subscribe(redis_url, timeout=interval):
                    if lost and events is not None:  # Redis answered: subscribed
                        _note("receiving Redis's events again")
                        lost = False
                    yield events
            except redis.RedisError as exc:
                # The store stays the truth: without events, it is looked at on a clock.
                if not lost:
                    said = first_line(exc, typed=False)
                    _note(f"lost Redis's events ({said}); looking every {interval:g}s")
                    lost = True
        time.sleep(interval)
        yield None
