"""Notifier calls on threads of the engine's own.

A notifier called where a run paused held that thread (a Celery worker's pool
thread) for as long as it took, and ``tick`` called the notifiers one after
another: while a webhook was down, ticks piled up behind one another until they
held every pool thread, and no run started. Here a few threads per engine make
the calls; whoever asks for one returns at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from agentruns.errors import NotifierError
from agentruns.runs import Run

log = logging.getLogger("agentruns")

# Notifier calls at once per engine (a worker process): runs announced beyond them
# wait their turn, each asked for once however often.
THREADS = 8
# How long a thread with nothing to announce waits for more before it ends.
_IDLE_S = 60.0


class Announcer:
    """Calls ``announce`` for a waiting run on a thread of its own, once per wait point
    while that call is queued or under way."""

    def __init__(
        self,
        announce: Callable[[Run], None],
        report: Callable[[Exception], None],
        threads: int = THREADS,
    ) -> None:
        self._announce = announce
        self._report = report
        self._most = threads
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._due: dict[str, Run] = {}  # by token id, oldest first: asked for, not taken
        self._taken: set[str] = set()  # under way
        self._threads = 0
        self._closed = False

    def ask(self, run: Run) -> str | None:
        """Announce ``run``'s wait point soon, unless that is asked for already; the
        wait point's token id (for ``wait_for``)."""
        wait = run.waiting
        if wait is None:
            return None
        with self._lock:
            if self._closed or wait.token_id in self._due or wait.token_id in self._taken:
                return wait.token_id
            self._due[wait.token_id] = run
            if self._threads < min(self._most, len(self._due) + len(self._taken)):
                self._threads += 1
                threading.Thread(target=self._serve, name="agentruns-notify", daemon=True).start()
            else:
                self._changed.notify_all()
            return wait.token_id

    def wait_for(self, token_ids: set[str]) -> None:
        """Return once no call for these wait points is asked for or under way."""
        with self._lock:
            while token_ids & (self._due.keys() | self._taken):
                self._changed.wait()

    def busy(self) -> bool:
        """Whether a call is asked for or under way."""
        with self._lock:
            return bool(self._due or self._taken)

    def close(self, timeout: float) -> None:
        """Take no more, and make what is asked for, ``timeout`` seconds at most; then
        drop what is left in line and leave what is under way (``tick`` asks for it
        again, on any engine, since it is not marked announced). What is left is
        logged, unless ``timeout`` is 0: such a caller waited already, and said so."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closed = True
            while (self._due or self._taken) and self._changed.wait(
                max(0.0, deadline - time.monotonic())
            ):
                pass
            if (self._due or self._taken) and timeout > 0:
                log.warning(
                    "%d notifier call(s) left at close (%d under way): a tick calls them again",
                    len(self._due) + len(self._taken),
                    len(self._taken),
                )
            self._due.clear()
            self._changed.notify_all()

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._due:
                    if self._closed or (not self._changed.wait(_IDLE_S) and not self._due):
                        self._threads -= 1
                        return
                token_id, run = next(iter(self._due.items()))
                del self._due[token_id]
                self._taken.add(token_id)
            try:
                self._announce(run)
            except Exception as exc:
                self._report(exc)
            except BaseException as exc:  # a notifier's SystemExit ends no thread here
                self._report(NotifierError(run.id, exc))
            finally:
                with self._lock:
                    self._taken.discard(token_id)
                    self._changed.notify_all()
