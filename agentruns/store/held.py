"""The hot path's own few connections, held between its statements (see ``Held``)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import psycopg
import sqlalchemy as sa
from psycopg import pq

from agentruns.store.connect import closed

IDLE = pq.TransactionStatus.IDLE


class Session(Protocol):
    """What the hot path keeps per connection; here, only its driver connection counts."""

    driver: psycopg.Connection[Any]


S = TypeVar("S", bound=Session)


class Held(Generic[S]):
    """Pooled connections the hot path keeps checked out between its statements.

    A checkout from SQLAlchemy's pool and the checkin after it are some fifty
    Python calls, cold in the CPU's caches by the next step: in a run's loop
    they were about a sixth of the engine's CPU per model step (bench figure
    1). So a write gives its connection back here, and the next write takes it
    from here before it asks the pool:

    - only a few are held (``limit``: a quarter of the pool, at most 4), so
      reads and every other caller still find the pool's other connections;
      a write in flight takes a fraction of a millisecond, so a few serve a
      worker's hundred threads;
    - each goes back to the pool once it has been out of it for ``HOLD_S``
      seconds, so the pool's recycling and invalidation still reach it;
    - only an idle connection (no transaction open) that served its statement
      is held; a broken one is invalidated by the caller and goes back;
    - when a connection breaks or cannot be made, here or anywhere on the
      engine, the held ones go back invalidated: they reconnect on their next
      checkout instead of failing a write each after the database was away.
      (The pool itself has no pre-ping: see ``connect.py``.)
    - ``release`` (the store's ``close``) gives them all back.
    """

    HOLD_S = 30.0
    MOST = 4

    def __init__(self, engine: sa.Engine, session_of: Callable[[Any], S]) -> None:
        self.engine = engine
        self.session_of = session_of
        pool = engine.pool
        self.limit = min(self.MOST, pool.size() // 4) if isinstance(pool, sa.QueuePool) else 0
        # (connection, its session, when it left the pool); append and pop are atomic.
        self.idle: deque[tuple[Any, S, float]] = deque()
        sa.event.listen(engine, "handle_error", self._on_error)
        sa.event.listen(engine, "engine_disposed", self._on_disposed)

    def take(self) -> tuple[Any, S, float]:
        idle = self.idle
        if idle:
            self._age_out(idle)
        while True:
            try:
                held = idle.pop()  # the newest: the most recently used connection
            except IndexError:
                break
            if not closed(held[1].driver):
                return held
            # The server ended it while it was held (a restart, a terminated
            # backend): replaced before a write is sent on it, which would have
            # failed and aborted its execution. Each other is looked at as it is taken.
            held[0].invalidate()
            held[0].close()
        try:
            pooled = self.engine.raw_connection()
        except psycopg.OperationalError as exc:
            # The pool hands out the driver's own error; callers (and the engine's
            # test for infrastructure errors) expect SQLAlchemy's, as from any query.
            self.drop()
            raise sa.exc.OperationalError("connect", None, exc) from exc
        return pooled, self.session_of(pooled), time.monotonic()

    def give(self, pooled: Any, session: S, since: float, reusable: bool) -> None:
        # Two threads may both see room and both append: the limit is approximate.
        if (
            reusable
            and len(self.idle) < self.limit
            and time.monotonic() - since < self.HOLD_S
            and session.driver.pgconn.transaction_status == IDLE
        ):
            self.idle.append((pooled, session, since))
        else:
            pooled.close()

    def _age_out(self, idle: deque[tuple[Any, S, float]]) -> None:
        # The oldest may sit unused while the newest serves every write: it too goes
        # back to the pool once out of it for HOLD_S (one per take is enough).
        try:
            oldest = idle[0]
            if time.monotonic() - oldest[2] < self.HOLD_S:
                return
            idle.remove(oldest)
        except (IndexError, ValueError):
            return  # another thread took it meanwhile
        oldest[0].close()

    def release(self, invalidate: bool = False) -> None:
        while True:
            try:
                pooled, _, _ = self.idle.pop()
            except IndexError:
                return
            if invalidate:
                pooled.invalidate(soft=True)  # reconnects when next checked out
            pooled.close()

    def close(self) -> None:
        """Give them all back, and stop listening to the engine: the listener sits
        on its dialect, which SQLAlchemy's caches keep, and would keep this engine
        (and its store) alive after the store's ``close``."""
        self.release()
        for event, listener in (
            ("handle_error", self._on_error),
            ("engine_disposed", self._on_disposed),
        ):
            if sa.event.contains(self.engine, event, listener):
                sa.event.remove(self.engine, event, listener)

    def drop(self) -> None:
        """Give them all back to be reconnected: a connection broke."""
        self.release(invalidate=True)

    def _on_disposed(self, engine: sa.Engine) -> None:
        # The pool was replaced under them: a forked child's (connect.py) are the
        # parent's connections, to be dropped, never closed or written on.
        self.idle.clear()

    def _on_error(self, context: sa.engine.ExceptionContext) -> None:
        # A broken connection, or one that could not be made (the server is away):
        # the held ones may be gone too, and nothing else would find out.
        if context.is_disconnect or isinstance(
            context.original_exception, psycopg.OperationalError
        ):
            self.drop()
