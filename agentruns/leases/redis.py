"""Leases in Redis, shared by every process that uses the same Redis and prefix."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from agentruns.errors import first_line
from agentruns.leases.local import AbortHandlers

logger = logging.getLogger(__name__)

_SCRIPTS = Path(__file__).parent
# Bounds every command, so a dead Redis fails a renewal instead of hanging it.
_SOCKET_TIMEOUT_S = 5.0
_HEALTH_CHECK_S = 15
_POLL_S = 0.2  # how often the listener looks at the stop flag
_SUBSCRIBE_WAIT_S = 2.0
_BACKOFF_MIN_S = 0.1
_BACKOFF_MAX_S = 2.0


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def scoped(client: redis.Redis, channel: str) -> str:
    """``channel`` for the database ``client`` uses: Redis' pub/sub is one for the
    whole server, and two deployments on its databases 0 and 1 (staging beside
    production) heard each other's aborts and events."""
    db = client.connection_pool.connection_kwargs.get("db", 0)
    return f"{channel}@{db}"


class RedisLeases:
    """A lease per run is a key holding its owner (``SET NX PX``); aborts go over pub/sub.

    Abort handlers run in one daemon listener thread per instance, started by the
    first ``on_abort_request``; keep them short. Pub/sub delivers at most once:
    an abort requested while the listener is reconnecting is lost, so holders
    must also notice cancellation some other way (e.g. at their next write).
    """

    def __init__(
        self,
        url: str = "redis://localhost:6379/0",
        *,
        prefix: str = "agentruns",
        client: redis.Redis | None = None,
    ) -> None:
        self._owns_client = client is None
        self._client = client or redis.Redis.from_url(
            url,
            socket_timeout=_SOCKET_TIMEOUT_S,
            socket_connect_timeout=_SOCKET_TIMEOUT_S,
            health_check_interval=_HEALTH_CHECK_S,
            # One immediate retry replaces a pooled connection that died with a Redis restart.
            retry=Retry(NoBackoff(), 1),
        )
        self._prefix = prefix
        self._abort_channel = scoped(self._client, f"{prefix}:abort")
        self._renew = self._client.register_script((_SCRIPTS / "renew.lua").read_text())
        self._release = self._client.register_script((_SCRIPTS / "release.lua").read_text())
        self._handlers = AbortHandlers()
        self._start_lock = threading.Lock()
        self._listener: threading.Thread | None = None
        self._subscribed = threading.Event()
        self._stopping = threading.Event()

    def _key(self, run_id: str) -> str:
        return f"{self._prefix}:lease:{run_id}"

    @staticmethod
    def _ms(ttl_s: float) -> int:
        return max(1, round(ttl_s * 1000))

    def acquire(self, run_id: str, owner: str, ttl_s: float) -> bool:
        return bool(self._client.set(self._key(run_id), owner, nx=True, px=self._ms(ttl_s)))

    def renew(self, run_id: str, owner: str, ttl_s: float) -> bool:
        return bool(self._renew(keys=[self._key(run_id)], args=[owner, self._ms(ttl_s)]))

    def release(self, run_id: str, owner: str) -> bool:
        return bool(self._release(keys=[self._key(run_id)], args=[owner]))

    def holder(self, run_id: str) -> str | None:
        owner = self._client.get(self._key(run_id))
        return None if owner is None else _text(owner)

    def give_up(self, run_id: str, epoch: int, ttl_s: float) -> None:
        key = f"{self._prefix}:given-up:{run_id}:{epoch}"
        self._client.set(key, b"1", px=self._ms(ttl_s))

    def given_up(self, run_id: str, epoch: int) -> bool:
        return bool(self._client.exists(f"{self._prefix}:given-up:{run_id}:{epoch}"))

    def request_abort(self, run_id: str) -> None:
        self._client.publish(self._abort_channel, run_id)

    def on_abort_request(self, handler: Callable[[str], None]) -> Callable[[], None]:
        """Register ``handler``; returns once the subscription is live (or after 2 s
        if Redis is unreachable: the listener keeps retrying in the background)."""
        unregister = self._handlers.add(handler)
        with self._start_lock:
            if self._listener is None and not self._stopping.is_set():
                self._listener = threading.Thread(
                    target=self._listen,
                    name=f"agentruns-abort-listener[{self._prefix}]",
                    daemon=True,
                )
                self._listener.start()
        self._subscribed.wait(_SUBSCRIBE_WAIT_S)
        return unregister

    def _listen(self) -> None:
        backoff = _BACKOFF_MIN_S
        lost = False  # said once per outage, with its traceback; then that it is back
        while not self._stopping.is_set():
            pubsub = self._client.pubsub()  # type: ignore[no-untyped-call,unused-ignore]  # typed only in newer redis-py
            try:
                pubsub.subscribe(self._abort_channel)
                while not self._stopping.is_set():
                    message = pubsub.get_message(timeout=_POLL_S)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        self._subscribed.set()
                        backoff = _BACKOFF_MIN_S
                        if lost:
                            logger.warning("abort listener reconnected to Redis")
                            lost = False
                    elif message["type"] == "message":
                        self._handlers.call(_text(message["data"]))
            except (redis.RedisError, OSError) as exc:
                self._subscribed.clear()
                # Once per outage, not once per retry (every 2 s, in every process), in
                # one line: its traceback (about 75 lines of redis-py) said no more.
                if lost:
                    logger.debug("abort listener: Redis still away", exc_info=True)
                else:
                    logger.warning(
                        "abort listener lost Redis (%s); reconnecting in %.1fs",
                        first_line(exc),
                        backoff,
                    )
                lost = True
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
            finally:
                pubsub.close()

    def close(self) -> None:
        with self._start_lock:
            self._stopping.set()
            listener = self._listener
        if listener is not None:
            listener.join(timeout=_POLL_S + _SOCKET_TIMEOUT_S)
        if self._owns_client:
            self._client.close()  # also closes the pool from_url made
