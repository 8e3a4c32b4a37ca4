"""agentruns' Redis transport for Celery: the same transport, one Redis client per channel."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection

from agentruns.broker import TRANSPORT, Transport
from agentruns.celery import _pick_transport
from tests.conftest import REDIS_URL


def _clients_made_by(transport: str | None, monkeypatch: pytest.MonkeyPatch) -> int:
    """Redis clients built while 20 messages are published, received and acked."""
    made = 0
    init = redis.Redis.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        nonlocal made
        made += 1
        init(self, *args, **kwargs)

    queue = f"agentruns-test-broker-{uuid.uuid4().hex[:8]}"
    with Connection(REDIS_URL, transport=transport) as conn:
        simple = conn.SimpleQueue(queue)
        try:
            monkeypatch.setattr(redis.Redis, "__init__", counting)
            for i in range(20):
                simple.put({"n": i})
            for _ in range(20):
                simple.get(timeout=5).ack()
            monkeypatch.setattr(redis.Redis, "__init__", init)
        finally:
            simple.clear()
            simple.close()
    return made


def test_the_transport_builds_one_redis_client_per_channel_not_one_per_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _clients_made_by(None, monkeypatch) >= 20  # kombu's own: one per publish or ack
    assert _clients_made_by(TRANSPORT, monkeypatch) <= 2


def test_the_shared_client_follows_a_channel_that_replaced_its_pool() -> None:
    with Connection(REDIS_URL, transport=TRANSPORT) as conn:
        channel = conn.default_channel
        first = channel._create_client()
        assert channel._create_client() is first
        channel._pool = None  # as after a disconnect
        second = channel._create_client()
        assert second is not first and second.connection_pool is channel.pool
        assert second.ping()


@pytest.mark.parametrize(
    ("broker_url", "configured", "chosen"),
    [
        ("redis://localhost:6379/0", None, TRANSPORT),
        ("rediss://localhost:6380/0", None, TRANSPORT),
        ("amqp://guest@localhost//", None, None),  # another broker keeps Celery's transport
        ("redis://localhost:6379/0", "redis", "redis"),  # an explicit choice stands
    ],
)
def test_a_redis_broker_gets_the_transport_unless_the_configuration_says_otherwise(
    broker_url: str, configured: str | None, chosen: str | None
) -> None:
    app = Celery("pick", set_as_current=False)
    app.on_after_configure.connect(_pick_transport)
    app.conf.update(broker_url=broker_url, broker_transport=configured)
    assert app.conf.broker_transport == chosen


def test_the_agentruns_app_connects_through_it() -> None:
    from agentruns.celery import app

    assert str(app.conf.broker_url).startswith("redis://")  # the default, and the tests'
    with app.connection_for_write() as conn:
        assert isinstance(conn.transport, Transport)
