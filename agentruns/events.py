"""Events a process can listen to: ``run.updated`` and ``step.appended``, after commit."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
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


class Events:
    """Listeners per event type; a listener that raises goes to ``on_error`` and changes nothing."""

    def __init__(self, on_error: Callable[[Exception], None]) -> None:
        self._listeners: dict[EventType, list[Listener]] = {t: [] for t in EVENT_TYPES}
        self._lock = threading.Lock()
        self._on_error = on_error
        self._delivering = threading.local()

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

    def run_updated(self, run: Run) -> None:
        self._emit(Event("run.updated", run=run))

    def steps_appended(self, steps: list[Step]) -> None:
        for step in steps:
            self._emit(Event("step.appended", step=step))

    def _emit(self, event: Event) -> None:
        # An event a listener causes (it resumes the run, say) waits until every
        # listener has had the one being delivered: each sees a run's events in order.
        queued: deque[Event] | None = getattr(self._delivering, "queue", None)
        if queued is not None:
            queued.append(event)
            return
        queued = self._delivering.queue = deque([event])
        try:
            while queued:
                current = queued.popleft()
                for listener in self._listeners[current.type]:
                    try:
                        listener(current)
                    except Exception as exc:
                        self._on_error(exc)
        finally:
            self._delivering.queue = None
