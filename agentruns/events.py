"""Events a process can listen to: ``run.updated`` and ``step.appended``, after commit."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

from agentruns.errors import stops_the_task
from agentruns.runs import Run, Step

log = logging.getLogger("agentruns")

EventType = Literal["run.updated", "step.appended"]
EVENT_TYPES: tuple[EventType, ...] = ("run.updated", "step.appended")


@dataclass(frozen=True)
class Event:
    type: EventType
    run: Run | None = None
    step: Step | None = None


Listener = Callable[[Event], None]


class RunUpdated(Protocol):
    """A ``run.updated`` event as its listeners may rely on it (for type checkers:
    an ``Event`` whose ``run`` is set)."""

    @property
    def type(self) -> Literal["run.updated"]: ...
    @property
    def run(self) -> Run: ...


class StepAppended(Protocol):
    """A ``step.appended`` event as its listeners may rely on it (an ``Event`` whose
    ``step`` is set)."""

    @property
    def type(self) -> Literal["step.appended"]: ...
    @property
    def step(self) -> Step: ...


def _wanted(listener: Listener) -> bool:
    wanted: Callable[[], bool] | None = getattr(listener, "wanted", None)
    return wanted is None or wanted()


class _RunQueue:
    """One run's events not yet delivered, and who may write or deliver them."""

    __slots__ = ("delivering", "events", "run_id", "users", "write_lock")

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.write_lock = threading.RLock()
        self.events: deque[Event] = deque()
        self.delivering = False
        self.users = 0


class Events:
    """Listeners per event type; a listener that raises goes to ``on_error`` and changes nothing.

    A run's events reach every listener in the order its writes committed, whichever
    threads wrote (a resume in a web handler, the execution it started in a pool):
    each write holds ``writing(run_id)`` from before its commit until its events are
    queued, and one thread at a time delivers a run's queue, the events other
    threads queue meanwhile included. An event a listener causes (it answers the
    approval, dispatches another run) waits until every listener has had the one
    being delivered, and is delivered by the same thread after it.
    """

    def __init__(self, on_error: Callable[[Exception], None]) -> None:
        self._listeners: dict[EventType, list[Listener]] = {t: [] for t in EVENT_TYPES}
        self._lock = threading.Lock()
        self._on_error = on_error
        self._queues: dict[str, _RunQueue] = {}
        self._queues_lock = threading.Lock()
        self._undelivered = 0  # events queued and not yet had by every listener
        self._local = threading.local()

    def on(self, event_type: EventType, listener: Listener) -> Callable[[], None]:
        if event_type not in self._listeners:
            raise ValueError(f"unknown event {event_type!r}; use one of {EVENT_TYPES}")
        if not callable(listener):  # else every event would report its TypeError
            raise TypeError(f"a listener is a function of the event, not {listener!r}")
        with self._lock:
            self._listeners[event_type] = [*self._listeners[event_type], listener]

        def unsubscribe() -> None:
            with self._lock:
                self._listeners[event_type] = [
                    x for x in self._listeners[event_type] if x is not listener
                ]

        return unsubscribe

    def busy(self) -> bool:
        """Are events waiting for their listeners, or being delivered?"""
        return self._undelivered > 0

    @contextlib.contextmanager
    def writing(self, run_id: str) -> Iterator[None]:
        """Hold around a write to a run and the events it makes (see the class)."""
        queue = self._use(run_id)
        depths = self._depths()
        try:
            with queue.write_lock:
                depths[run_id] = depths.get(run_id, 0) + 1
                try:
                    yield
                finally:
                    depths[run_id] -= 1
                    if not depths[run_id]:
                        del depths[run_id]
            if run_id not in depths:
                self._deliver(queue)
        finally:
            self._let_go(queue)

    def wants(self, event_type: EventType) -> bool:
        """Has the event type a listener that wants it now? An event nobody listens to
        is not made: one comes with every write, in the step's own time. A listener
        may say it wants none for now (``wanted()``: a worker's publisher while no
        watcher is subscribed, which would drop them)."""
        return any(_wanted(listener) for listener in self._listeners[event_type])

    def run_updated(self, run: Run) -> None:
        if self.wants("run.updated"):
            self._emit(run.id, Event("run.updated", run=run))

    def steps_appended(self, steps: list[Step]) -> None:
        if self.wants("step.appended"):
            for step in steps:
                self._emit(step.run_id, Event("step.appended", step=step))

    def _emit(self, run_id: str, event: Event) -> None:
        queue = self._use(run_id)
        try:
            with self._queues_lock:
                queue.events.append(event)
                self._undelivered += 1
            # Inside a write, its events wait until it ends: a write after it, by
            # another thread, cannot queue its own before them.
            if run_id not in self._depths():
                self._deliver(queue)
        finally:
            self._let_go(queue)

    def _depths(self) -> dict[str, int]:
        """The runs this thread is inside ``writing`` of, and how deep."""
        depths: dict[str, int] | None = getattr(self._local, "depths", None)
        if depths is None:
            depths = self._local.depths = {}
        return depths

    def _use(self, run_id: str) -> _RunQueue:
        with self._queues_lock:
            queue = self._queues.get(run_id)
            if queue is None:
                queue = self._queues[run_id] = _RunQueue(run_id)
            queue.users += 1
            return queue

    def _let_go(self, queue: _RunQueue) -> None:
        with self._queues_lock:
            queue.users -= 1
            self._forget_if_done(queue)

    def _forget_if_done(self, queue: _RunQueue) -> None:
        if not queue.users and not queue.events and not queue.delivering:
            self._queues.pop(queue.run_id, None)

    def _deliver(self, queue: _RunQueue) -> None:
        """Deliver the run's queued events, unless this thread delivers already (a
        listener's call made them: they come after the current event) or another
        thread does (it takes these too, after the ones before them)."""
        later: list[_RunQueue] | None = getattr(self._local, "later", None)
        if later is not None:
            if all(q is not queue for q in later):
                with self._queues_lock:
                    queue.users += 1  # kept until this thread comes to it
                later.append(queue)
            return
        later = self._local.later = []
        try:
            self._drain(queue, later)  # and, after each event, what its listeners caused
        except BaseException:
            for held in later:  # the process is stopping: what was left goes
                self._drop(held)
                self._let_go(held)
            raise
        finally:
            self._local.later = None

    def _drain(self, queue: _RunQueue, later: list[_RunQueue]) -> None:
        with self._queues_lock:
            if queue.delivering:
                return
            queue.delivering = True
        try:
            while True:
                with self._queues_lock:
                    if not queue.events:
                        queue.delivering = False
                        self._forget_if_done(queue)
                        return
                    event = queue.events.popleft()
                try:
                    self._call_listeners(event)
                finally:
                    with self._queues_lock:
                        self._undelivered -= 1
                # What the listeners caused, before this run's next event.
                while later:
                    held = later.pop(0)
                    try:
                        self._drain(held, later)
                    finally:
                        self._let_go(held)
        except BaseException:
            self._drop(queue)
            raise

    def _drop(self, queue: _RunQueue) -> None:
        """Give up the run's queued events (a KeyboardInterrupt stops this thread)."""
        with self._queues_lock:
            self._undelivered -= len(queue.events)
            queue.events.clear()
            queue.delivering = False
            self._forget_if_done(queue)

    def _call_listeners(self, event: Event) -> None:
        for listener in self._listeners[event.type]:
            try:
                listener(event)
            except BaseException as exc:
                # What stops the task (a worker's time limit, a signal in the main
                # thread) goes on up. Anything else the listener raised itself
                # (argparse's exit, a cancelled asyncio task): raised on, it would end
                # the execution unsettled, its run left running until its lease expired.
                if stops_the_task(exc):
                    raise
                if isinstance(exc, Exception):
                    self._on_error(exc)
                else:
                    self._on_error(RuntimeError(f"a listener raised {exc!r}"))
