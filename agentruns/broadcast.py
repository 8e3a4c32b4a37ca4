"""Engine events over Redis pub/sub, so `agentruns watch` anywhere sees them live.

Publishing happens on a background thread: an execution only enqueues, so the
hot path gains no Redis round trip, and nothing at all while nobody watches.
Delivery is best effort; a watcher also polls the store, which stays the truth.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Iterator

import redis

from agentruns.events import Event
from agentruns.leases.redis import scoped

log = logging.getLogger("agentruns")


def channel(client: redis.Redis, prefix: str) -> str:
    return scoped(client, f"{prefix}:events")


def summary(event: Event) -> dict[str, object]:
    if event.run is not None:
        run = event.run
        return {
            "type": event.type,
            "run_id": run.id,
            "status": run.status.value,
            # Which state of the run this is: a watcher that has seen a later one drops it.
            "updated_at": run.updated_at.isoformat(),
        }
    assert event.step is not None
    return {"type": event.type, "run_id": event.step.run_id, "index": event.step.index}


class EventPublisher:
    """An engine listener (``engine.on(..., publisher)``) that publishes event summaries."""

    # How often the publisher asks Redis whether anyone is subscribed.
    LOOK_EVERY_S = 0.25

    def __init__(self, url: str, *, prefix: str = "agentruns", maxsize: int = 10_000) -> None:
        self._client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self._channel = channel(self._client, prefix)
        self._queue: queue.Queue[dict[str, object] | None] = queue.Queue(maxsize)
        # Until the first look says otherwise, someone may be watching: a short
        # command (`agentruns cancel`) made no event before its first look.
        self._listening = True
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="agentruns-events", daemon=True)
        self._thread.start()

    def wanted(self) -> bool:
        """Are events wanted now (``Events.wants``)? Not while nobody watches: the
        engine then does not make them, a saving on every write of a worker."""
        return self._listening

    def __call__(self, event: Event) -> None:
        # With nobody watching, an event costs nothing; when the queue is full,
        # watchers fall back to polling: a run is never slowed down for them.
        if self._listening:
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(summary(event))

    def _run(self) -> None:
        next_look = 0.0
        while True:
            if time.monotonic() >= next_look:
                self._listening = self._anyone_listening()
                next_look = time.monotonic() + self.LOOK_EVERY_S
            try:
                item = self._queue.get(timeout=self.LOOK_EVERY_S)
            except queue.Empty:
                if self._closing:  # all published (a full queue took no wake-up)
                    return
                continue
            if item is None:  # after what was queued before close()
                return
            batch = [item]
            while not self._queue.empty() and len(batch) < 500:
                nxt = self._queue.get_nowait()
                if nxt is None:
                    self._publish(batch)
                    return
                batch.append(nxt)
            self._publish(batch)

    def _anyone_listening(self) -> bool:
        try:
            counts = self._client.pubsub_numsub(self._channel)
        except redis.RedisError:
            return False
        return any(int(n) > 0 for _, n in counts)

    def _publish(self, batch: list[dict[str, object]]) -> None:
        try:
            pipe = self._client.pipeline(transaction=False)
            for item in batch:
                pipe.publish(self._channel, json.dumps(item))
            pipe.execute()
        except Exception as exc:  # best effort: this thread must not die of it
            log.debug("could not publish %d events: %s", len(batch), exc)

    def close(self) -> None:
        """Publish what is queued, then stop; never waits long (5 s, for a Redis that
        stalls). What a short command did (`agentruns cancel`) was queued just before
        its close, and was dropped: a watcher saw it a poll later, or, for a run
        outside its window, not at all."""
        self._closing = True
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)  # wakes the thread if it waits for events
        self._thread.join(timeout=5)
        if not self._thread.is_alive():  # else it is stuck on a stalled Redis: leave it
            self._client.close()


def subscribe(
    url: str, *, prefix: str = "agentruns", timeout: float = 0.5
) -> Iterator[list[dict[str, object]] | None]:
    """Event summaries as they are published: all those that have arrived, at once
    (a reader that looks once per wake-up keeps up at any rate of events); first an
    empty list, once Redis confirms the subscription; None every ``timeout`` seconds
    of quiet."""
    client = redis.Redis.from_url(url, socket_connect_timeout=5)
    pubsub = client.pubsub()  # type: ignore[no-untyped-call,unused-ignore]  # typed only in newer redis-py
    try:
        pubsub.subscribe(channel(client, prefix))
        while True:
            message = pubsub.get_message(timeout=timeout)
            if message is None:
                yield None
                continue
            batch: list[dict[str, object]] = []
            while message is not None and len(batch) < _MOST_AT_ONCE:
                if message.get("type") == "message":
                    with contextlib.suppress(ValueError):
                        event = json.loads(message["data"])
                        if isinstance(event, dict):
                            batch.append(event)
                message = pubsub.get_message(timeout=0)
            yield batch
    finally:
        pubsub.close()
        client.close()


_MOST_AT_ONCE = 1000  # events read before the reader gets them
