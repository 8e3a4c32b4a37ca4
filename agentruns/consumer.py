"""The worker's Celery consumer: Celery's own, sending task events in batches, and
draining the worker's runs when it stops for a reason no signal told (a remote
``celery control shutdown``).

With task events on (for Flower), a worker sends three events per task. Celery
buffers them and publishes whatever is buffered at the event loop's next turn;
a busy worker's loop turns for nearly every message, so it published one to a
few events per Redis ``PUBLISH``, a fifth of its consumer thread's time. This
consumer publishes the buffer at most every ``EVENT_BATCH_S`` instead: Flower
sees a task's events that much later, and a busy worker sends them a few dozen
to a message. (``worker_consumer = "celery.worker.consumer:Consumer"`` in
``celeryconfig.py`` goes back to Celery's.)
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from celery.worker.consumer import Consumer as CeleryConsumer

# How long a task event may wait for others to go out with it.
EVENT_BATCH_S = 0.05


class Consumer(CeleryConsumer):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # When the armed flush is due; None when none is armed.
        self._event_flush_at: float | None = None

    def on_send_event_buffered(self) -> None:
        # Called from any thread that sent an event; call_soon is the hub's
        # thread-safe door, and the timer is armed in the loop's own thread.
        if self.hub is None:
            super().on_send_event_buffered()
            return
        now = time.monotonic()
        due = self._event_flush_at
        # Overdue by a second: its timer went with a reconnection; arm another.
        if due is None or now > due + 1.0:
            self._event_flush_at = now + EVENT_BATCH_S
            self.hub.call_soon(self._arm_event_flush)

    def _arm_event_flush(self) -> None:
        self.hub.call_later(EVENT_BATCH_S, self._flush_event_batch)

    def _flush_event_batch(self) -> None:
        self._event_flush_at = None  # events sent from now on arm the next flush
        if self.event_dispatcher is not None:
            self.event_dispatcher.flush()

    def cancel_active_requests(self) -> None:
        # Cold shutdown (SIGQUIT, or SIGTERM with REMAP_SIGTERM=SIGQUIT) cancels the
        # tasks in flight. Only a prefork pool can: it kills their processes, and for
        # their runs that is a crash (recover resumes them). Another pool's cancel
        # raised inside the consumer (threads: the worker ended) or inside the run
        # itself (solo: taken for the model's or a tool's error): their runs drain
        # instead, as on a warm shutdown, and their tasks return.
        from agentruns.worker import begin_shutdown, pool_kind

        if pool_kind(self.pool) == "prefork":
            super().cancel_active_requests()
        else:
            begin_shutdown()

    def close(self) -> None:
        # Celery's worker calls this first when it stops, warm or cold, for any cause
        # (its own Consumer has no such method). Signals already drained the runs;
        # a remote `celery control shutdown` sends none, so it drains here.
        from agentruns.worker import begin_shutdown

        begin_shutdown()

    def shutdown(self) -> None:
        # What is still buffered goes out before the dispatcher closes.
        with contextlib.suppress(Exception):
            if self.event_dispatcher is not None:
                self.event_dispatcher.flush()
        super().shutdown()
