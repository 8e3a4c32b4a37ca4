"""In-process leases: the same contract as RedisLeases, for one process."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class AbortHandlers:
    """The abort handlers registered in this process, called in registration order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._handlers: dict[int, Callable[[str], None]] = {}

    def add(self, handler: Callable[[str], None]) -> Callable[[], None]:
        with self._lock:
            handler_id = next(self._ids)
            self._handlers[handler_id] = handler

        def remove() -> None:
            with self._lock:
                self._handlers.pop(handler_id, None)

        return remove

    def call(self, run_id: str) -> None:
        # A snapshot, called outside the lock, so a handler may (un)register handlers.
        with self._lock:
            handlers = list(self._handlers.values())
        for handler in handlers:
            try:
                handler(run_id)
            except Exception:
                # One broken handler must not keep the abort from the others.
                logger.exception("abort handler %r failed for run %s", handler, run_id)


class LocalLeases:
    """Thread-safe leases held in this process's memory.

    Only engines sharing this object see each other's leases, so it suits the
    embedded mode and tests. ``request_abort`` calls the registered handlers
    synchronously, in the caller's thread, before it returns. Another process's
    cancel reaches none of them (``process_local``): engines look in the store.
    """

    process_local = True

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[str, tuple[str, float]] = {}  # run_id -> (owner, monotonic expiry)
        self._given_up: dict[tuple[str, int], float] = {}  # (run_id, epoch) -> expiry
        self._handlers = AbortHandlers()

    def _current(self, run_id: str, now: float) -> str | None:
        lease = self._leases.get(run_id)
        if lease is None:
            return None
        owner, expires_at = lease
        if expires_at <= now:
            del self._leases[run_id]
            return None
        return owner

    def acquire(self, run_id: str, owner: str, ttl_s: float) -> bool:
        with self._lock:
            now = time.monotonic()
            if self._current(run_id, now) is not None:
                return False
            self._leases[run_id] = (owner, now + ttl_s)
            return True

    def renew(self, run_id: str, owner: str, ttl_s: float) -> bool:
        with self._lock:
            now = time.monotonic()
            if self._current(run_id, now) != owner:
                return False
            self._leases[run_id] = (owner, now + ttl_s)
            return True

    def release(self, run_id: str, owner: str) -> bool:
        with self._lock:
            if self._current(run_id, time.monotonic()) != owner:
                return False
            del self._leases[run_id]
            return True

    def holder(self, run_id: str) -> str | None:
        with self._lock:
            return self._current(run_id, time.monotonic())

    def give_up(self, run_id: str, epoch: int, ttl_s: float) -> None:
        with self._lock:
            now = time.monotonic()
            self._given_up = {k: t for k, t in self._given_up.items() if t > now}
            self._given_up[(run_id, epoch)] = now + ttl_s

    def given_up(self, run_id: str, epoch: int) -> bool:
        with self._lock:
            return self._given_up.get((run_id, epoch), 0.0) > time.monotonic()

    def request_abort(self, run_id: str) -> None:
        self._handlers.call(run_id)

    def on_abort_request(self, handler: Callable[[str], None]) -> Callable[[], None]:
        return self._handlers.add(handler)

    def close(self) -> None:
        pass
