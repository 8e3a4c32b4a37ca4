"""Beat's scheduler: Celery's own, saying in one line a sweep it could not send.

While the broker was away, Celery's scheduler logged each sweep it could not send
with the stack of beat's main loop and a traceback, about 170 lines a sweep (with
the defaults, some 2,000 lines a minute). This one says it in one warning line; a
failure that is not the broker's connection is logged as Celery does.
(``beat_scheduler = "celery.beat:PersistentScheduler"`` in ``celeryconfig.py``
goes back to Celery's.)
"""

from __future__ import annotations

from typing import Any

import kombu.exceptions
import redis
from celery.beat import PersistentScheduler
from celery.beat import logger as log

from agentruns.errors import first_line

# What a send through an unreachable broker raises, after kombu's own retries. Not
# any OSError: writing the schedule file (a full disk) is no connection's.
_CONNECTION_ERRORS = (
    kombu.exceptions.OperationalError,
    redis.ConnectionError,
    redis.TimeoutError,
    ConnectionError,
    TimeoutError,
)


class Scheduler(PersistentScheduler):  # type: ignore[misc]
    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        log.info("Scheduler: Sending due task %s (%s)", entry.name, entry.task)
        try:
            self.apply_async(entry, producer=producer, advance=False)
        except Exception as exc:
            cause = _connection_error(exc)
            if cause is None:
                log.error("Message Error: %s", exc, exc_info=True)
            else:
                log.warning("beat could not send %s: %s", entry.name, first_line(cause))


def _connection_error(exc: BaseException) -> BaseException | None:
    """The broker connection's error that ``exc`` (Celery's ``SchedulingError``,
    raised while handling it) stands for, if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, _CONNECTION_ERRORS):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
