"""Celery's Redis transport, with one Redis client per channel instead of one per command.

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

from typing import Any

from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):
    """A kombu Redis channel that builds its synchronous client once."""

    _shared: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
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
