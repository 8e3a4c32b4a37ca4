"""What an outage of the database or Redis raises, said in one place.

An outage is neither the agent's fault nor the run's: an execution it interrupts
leaves its run to ``recover`` (not failed), a task retries, a sweep fails and the
next one comes, a watch looks again.
"""

from __future__ import annotations

import redis
import sqlalchemy.exc

# The database away, a connection dropped, or none free in time: the database is
# stalled (a lock held long, a slow disk), and every thread waits for its own back.
DATABASE_OUTAGE: tuple[type[Exception], ...] = (
    sqlalchemy.exc.OperationalError,
    sqlalchemy.exc.InterfaceError,
    sqlalchemy.exc.TimeoutError,
    sqlalchemy.exc.DisconnectionError,  # each connection ended as it was opened (connect.py)
)
# The database or Redis (leases, cancel signals, events) away or stalled.
OUTAGE: tuple[type[Exception], ...] = (
    *DATABASE_OUTAGE,
    redis.ConnectionError,
    redis.TimeoutError,
    OSError,
)


def is_outage(exc: BaseException) -> bool:
    return isinstance(exc, OUTAGE)
