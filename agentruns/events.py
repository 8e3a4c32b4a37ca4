"""Events a process can listen to: ``run.updated`` and ``step.appended``, after commit."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

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


class _RunQueue:
    """One run's events not yet delivered, and who may write or deliver them."""

    __slots__ = ("delivering", "events", "users", "write_lock")

    def __init__(self) -> None:
        self.write_lock = threading.RLock()
        self.events: deque[Event] = deque()
        self.delivering = False
        self.users = 0


class Events:
    """Listeners per event type; a listener that raises goes to ``on_error`` and changes nothing.

    A run's events reach every listener in the order its writes committed, whichever
    threads wrote (a resume in a web handler, the execution it started in a pool):
    each write holds ``writing(run_id)`` from before its commit until its events are
    queued, and one thread at a time delivers a run's queue.
    """

    def __init__(self, on_error: Callable[[Exception], None]) -> None:
        self._listeners: dict[EventType, list[Listener]] = {t: [] for t in EVENT_TYPES}
        self._lock = threading.Lock()
        self._on_error = on_error
        self._queues: dict[str, _RunQueue] = {}
        self._queues_lock = threading.Lock()
        self._undelivered = 0  # events queued and not yet had by every listener
        self._writing = threading.local()

    def on(self, event_type: EventType, listener: Listener) -> Callable[[], None]:
        if event_type not in self._listeners:
            raise ValueError(f"unknown event {event_type!r}; use one of {EVENT_TYPES}")
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
        depth = self._depths()
        try:
            with queue.write_lock:
                depth[run_id] = depth.get(run_id, 0) + 1
                try:
                    yield
                finally:
                    depth[run_id] -= 1
                    if not depth[run_id]:
                        del depth[run_id]
        finally:
            if run_id not in depth:
                self._deliver(queue)
            self._let_go(run_id, queue)

    def run_updated(self, run: Run) -> None:
        self._emit(run.id, Event("run.updated", run=run))

    def steps_appended(self, steps: list[Step]) -> None:
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
            self._let_go(run_id, queue)

    def _depths(self) -> dict[str, int]:
        """The runs this thread is inside ``writing`` of, and how deep."""
        depths: dict[str, int] | None = getattr(self._writing, "depths", None)
        if depths is None:
            depths = self._writing.depths = {}
        return depths

    def _use(self, run_id: str) -> _RunQueue:
        with self._queues_lock:
            queue = self._queues.get(run_id)
            if queue is None:
                queue = self._queues[run_id] = _RunQueue()
            queue.users += 1
            return queue

    def _let_go(self, run_id: str, queue: _RunQueue) -> None:
        with self._queues_lock:
            queue.users -= 1
            if not queue.users and not queue.events and not queue.delivering:
                del self._queues[run_id]

    def _deliver(self, queue: _RunQueue) -> None:
        """Deliver the run's queued events, unless a thread does already: it takes
        these too, after the one it delivers (an event a listener causes, say)."""
        with self._queues_lock:
            if queue.delivering:
                return
            queue.delivering = True
        try:
            while True:
                with self._queues_lock:
                    if not queue.events:
                        queue.delivering = False
                        return
                    event = queue.events.popleft()
                try:
                    for listener in self._listeners[event.type]:
                        try:
                            listener(event)
                        except Exception as exc:
                            self._on_error(exc)
                        except (KeyboardInterrupt, SystemExit) as exc:
                            # In a pool's thread no signal raised it, the listener did
                            # (argparse's exit): raised on, it would end the execution
                            # unsettled, its run left running until its lease expired.
                            if threading.current_thread() is threading.main_thread():
                                raise
                            self._on_error(RuntimeError(f"a listener raised {exc!r}"))
                finally:
                    with self._queues_lock:
                        self._undelivered -= 1
        except BaseException:
            with self._queues_lock:
                queue.delivering = False
            raise
