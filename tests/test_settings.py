"""Settings and what an engine built from them refuses; the event publisher's shutdown."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
from pydantic import ValidationError

from agentruns import Engine, LocalLeases, SqlStore
from agentruns.broadcast import EventPublisher
from agentruns.errors import AgentrunsError
from agentruns.settings import Settings
from agentruns.wiring import engine_from_settings
from tests.conftest import REDIS_URL


@pytest.mark.parametrize(
    "name", ["lease_ttl", "requeue_after", "tick_interval", "recover_interval"]
)
@pytest.mark.parametrize("value", ["inf", "nan", "1e12", "0"])
def test_times_that_are_not_a_finite_positive_number_of_seconds_are_refused(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # inf or 1e12 s passed before, then failed every execution (a lease expiry past
    # the year 9999), recover(), or beat's start.
    monkeypatch.setenv(f"AGENTRUNS_{name.upper()}", value)
    with pytest.raises(ValidationError, match=name):
        Settings()


def test_an_engine_refuses_lease_and_requeue_times_that_are_not_finite(sqlite_url: str) -> None:
    for times in (
        {"lease_ttl": float("inf")},
        {"lease_ttl": float("nan")},
        {"requeue_after": 1e12},
    ):
        with pytest.raises(ValueError, match="lease_ttl and requeue_after"):
            Engine(SqlStore(sqlite_url), leases=LocalLeases(), secret="s", **times)


def test_an_engine_built_for_several_processes_needs_their_shared_secret(sqlite_url: str) -> None:
    settings = Settings(database_url=sqlite_url, redis_url=REDIS_URL, agents="")
    with pytest.raises(AgentrunsError, match="AGENTRUNS_SECRET is not set"):
        engine_from_settings(settings)
    engine_from_settings(settings.model_copy(update={"secret": "shared"})).close()


def test_closing_the_event_publisher_on_a_stalled_redis_neither_hangs_nor_breaks() -> None:
    # A "Redis" that accepts connections and never answers: the publisher's thread
    # is stuck in a command, and its queue is full.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    died: list[Any] = []
    before, threading.excepthook = threading.excepthook, died.append
    try:
        publisher = EventPublisher(f"redis://127.0.0.1:{silent.getsockname()[1]}", maxsize=10)
        publisher._listening = True  # as if a watcher were subscribed
        for i in range(20):
            publisher(_Event(i))  # type: ignore[arg-type]
        started = time.monotonic()
        publisher.close()
        # It gives its thread one wait (5 s) and leaves it, instead of queueing behind it.
        assert time.monotonic() - started < 8
        time.sleep(1)
        assert died == []  # the thread was not pulled out from under itself
    finally:
        threading.excepthook = before
        silent.close()


class _Event:
    type = "step.appended"
    run = None

    def __init__(self, index: int) -> None:
        self.step = type("Step", (), {"run_id": "r", "index": index})()
