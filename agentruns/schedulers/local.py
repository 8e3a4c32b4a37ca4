"""LocalScheduler: executions on a pool of threads in this process (the embedded mode)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

log = logging.getLogger("agentruns")


class LocalScheduler:
    def __init__(self, slots: int | None = None) -> None:
        self._slots = slots
        self._pool: ThreadPoolExecutor | None = None
        self._execute: Callable[[str], object] | None = None
        self._outstanding = 0
        self._not_started = 0
        self._lock = threading.Lock()
        self._closed = False

    def bind(self, execute: Callable[[str], object], slots: int = 8) -> None:
        self._execute = execute
        # Two threads per slot: the engine's slots bound the executions, and a thread
        # whose execution is over may still be announcing its wait (a notifier can
        # take long) while another run takes the slot.
        self._pool = ThreadPoolExecutor(
            max_workers=2 * (self._slots or slots), thread_name_prefix="agentruns-run"
        )

    def schedule(self, run_id: str) -> None:
        if self._pool is None or self._execute is None:
            raise RuntimeError("LocalScheduler is not bound to an engine")
        with self._lock:
            if self._closed:
                return  # the run stays queued; recover() will find it
            self._outstanding += 1
            self._not_started += 1
        try:
            future = self._pool.submit(self._start, run_id)
        except RuntimeError:
            with self._lock:
                self._not_started -= 1
            self._done(None)
            return
        future.add_done_callback(self._done)

    def _start(self, run_id: str) -> object:
        with self._lock:
            self._not_started -= 1
        assert self._execute is not None
        return self._execute(run_id)

    def _done(self, future: Future[object] | None) -> None:
        if future is not None and not future.cancelled() and future.exception() is not None:
            log.error("execution failed", exc_info=future.exception())
        with self._lock:
            self._outstanding -= 1

    def outstanding(self) -> int:
        with self._lock:
            return self._outstanding

    def waiting(self) -> int | None:
        """Executions scheduled here and not started: a thread takes each in turn."""
        with self._lock:
            return self._not_started

    def close(self) -> None:
        with self._lock:
            self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
