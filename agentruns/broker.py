"""Celery's Redis transport, with one Redis client per channel instead of one per
command; and ``send_together``, which sends a task and its ``task-sent`` event in
one round trip.

kombu's Redis channel builds a new ``redis.Redis`` object for every ack, every
published task event and every unacked-message record (``_create_client``),
and redis-py's constructor is not cheap: it copies its response-callback
tables each time. With acks late and task events on (both are agentruns
defaults), that is about five clients per task, built and dropped on the
worker's consumer thread. This transport keeps one per channel: a client is
only a handle on the channel's connection pool, and redis-py clients are safe
to share between threads (each command borrows its own pooled connection).

``agentruns.celery`` selects it (``broker_transport``) when the configured broker
URL is ``redis://`` or ``rediss://`` and no transport is set explicitly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from kombu import exceptions as kombu_exceptions
from kombu.transport import redis as kombu_redis
from kombu.utils.uuid import uuid

log = logging.getLogger("agentruns")
T = TypeVar("T")
# kombu 5.7 and later: what a failed publish batch raises (delivery uncertain).
_BATCH_FAILED: type[BaseException] | None = getattr(kombu_exceptions, "BatchPublishError", None)


class Channel(kombu_redis.Channel):
    """A kombu Redis channel that builds its synchronous client once."""

    _shared: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        if self._pool is None and getattr(self.connection, "client", None) is None:
            # The connection is closed, and kombu cannot make a pool for it (its
            # AttributeError ended the worker): it asks for a client as it closes a
            # channel after the connection was lost, to give unacked messages back
            # (acks late: every busy worker), and to ack a task that finishes later.
            # The channel's client still reaches the same Redis once it is back; with
            # none, a connection error lets the closing go on and the worker reconnect.
            if self._shared is not None and not asynchronous:
                return self._shared
            raise redis.ConnectionError("the broker connection is closed")
        if asynchronous:
            return super()._create_client(asynchronous=True)  # type: ignore[no-untyped-call]
        shared = self._shared
        # The channel may replace its pool (after a disconnect): follow it.
        if shared is None or shared.connection_pool is not self.pool:
            shared = self._shared = super()._create_client()  # type: ignore[no-untyped-call]
        return shared


class Transport(kombu_redis.Transport):
    """``kombu.transport.redis.Transport`` with :class:`Channel`."""

    Channel = Channel


TRANSPORT = f"{__name__}:Transport"


def transport_for(url: str) -> str | None:
    """The transport agentruns picks for a broker URL: its own for Redis, else Celery's."""
    return TRANSPORT if url.startswith(("redis://", "rediss://")) else None


def send_together(
    app: Any, send: Callable[[Any, str], T], producer: Any = None, task_id: str | None = None
) -> T:
    """``send(producer, task_id)``, with everything it publishes reaching the broker at once.

    Celery publishes a task's message and then, with ``task_send_sent_event`` (on
    in agentruns' settings, for Flower), its ``task-sent`` event: on Redis, two
    commands, each waiting for its reply. Inside kombu's publish batch (kombu 5.7
    and later) they go out as one pipeline when the batch closes, which is before
    this returns; a transport that cannot batch publishes at once, as before. Here
    that is one round trip and about an eighth of a producer's CPU less per send.
    Inside a batch the caller opened on ``producer`` (README, "Producers"), the
    caller's batch sends them, and no batch is opened inside it: kombu's nested
    batches share one state, so a send that fails (a trigger that is not JSON)
    would discard everything the caller's batch holds.

    A pipeline that fails may or may not have reached Redis. ``send`` then runs
    once more, the usual way (with Celery's publish retries), with the same
    ``task_id`` (one is made when none is given): a second copy is a duplicate,
    which every agentruns message is allowed to be (the claim decides, and a
    dispatch's idempotency key is the task id unless the caller gave one).
    """
    task_id = task_id or uuid()
    with app.producer_or_acquire(producer) as pooled:
        batch = getattr(pooled, "batch", None)
        if batch is None or _BATCH_FAILED is None or _batching(pooled):
            return send(pooled, task_id)
        try:
            with batch():
                return send(pooled, task_id)
        except _BATCH_FAILED as exc:
            log.warning("a batched publish failed (%s); sending it again", exc)
            return send(pooled, task_id)


def _batching(producer: Any) -> bool:
    """Whether this thread has a publish batch open on ``producer`` (kombu keeps it
    in ``Producer._batch_local``, per thread; it has no public way to ask)."""
    return getattr(getattr(producer, "_batch_local", None), "current", None) is not None
