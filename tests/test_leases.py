"""The lease contract, run against RedisLeases (the real Redis) and LocalLeases alike."""

from __future__ import annotations

import logging
import queue
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from agentruns.leases import Leases, LocalLeases, RedisLeases
from tests.conftest import REDIS_URL, wait_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def prefix(redis_prefix: str) -> str:
    return redis_prefix


@pytest.fixture(params=["redis", "local"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def leases(kind: str, prefix: str) -> Iterator[Leases]:
    made: Leases = RedisLeases(REDIS_URL, prefix=prefix) if kind == "redis" else LocalLeases()
    yield made
    made.close()


@pytest.fixture
def elsewhere(kind: str, prefix: str, leases: Leases) -> Iterator[Leases]:
    """The same leases as another engine sees them: for Redis, another client
    (as in another process); in-process leases are shared by being the same object."""
    if kind == "local":
        yield leases
        return
    other = RedisLeases(REDIS_URL, prefix=prefix)
    yield other
    other.close()


def collector() -> tuple[Callable[[str], None], queue.Queue[str]]:
    received: queue.Queue[str] = queue.Queue()
    return received.put, received


def test_both_implementations_satisfy_the_protocol(leases: Leases) -> None:
    assert isinstance(leases, Leases)


def test_acquire_is_exclusive(leases: Leases) -> None:
    assert leases.acquire("run-1", "a", 5)
    assert not leases.acquire("run-1", "b", 5)
    assert not leases.acquire("run-1", "a", 5)
    assert leases.holder("run-1") == "a"
    assert leases.acquire("run-2", "b", 5)


def test_another_owner_can_acquire_after_the_ttl_expires(leases: Leases) -> None:
    assert leases.acquire("run-1", "a", 0.1)
    time.sleep(0.2)
    assert leases.holder("run-1") is None
    assert leases.acquire("run-1", "b", 5)
    assert leases.holder("run-1") == "b"


def test_renew_by_another_owner_fails_and_does_not_extend_the_lease(leases: Leases) -> None:
    assert leases.acquire("run-1", "a", 0.3)
    assert not leases.renew("run-1", "b", 5)
    time.sleep(0.4)
    assert leases.holder("run-1") is None


def test_renew_by_the_owner_extends_the_lease(leases: Leases) -> None:
    assert leases.acquire("run-1", "a", 0.3)
    assert leases.renew("run-1", "a", 5)
    time.sleep(0.4)
    assert leases.holder("run-1") == "a"
    assert not leases.acquire("run-1", "b", 5)


def test_renew_of_an_expired_lease_fails(leases: Leases) -> None:
    assert leases.acquire("run-1", "a", 0.1)
    time.sleep(0.2)
    assert not leases.renew("run-1", "a", 5)
    assert leases.holder("run-1") is None


def test_release_by_another_owner_does_nothing(leases: Leases) -> None:
    assert leases.acquire("run-1", "a", 5)
    assert not leases.release("run-1", "b")
    assert leases.holder("run-1") == "a"


def test_release_by_the_owner_frees_the_lease(leases: Leases) -> None:
    assert leases.acquire("run-1", "a", 5)
    assert leases.release("run-1", "a")
    assert leases.holder("run-1") is None
    assert leases.acquire("run-1", "b", 5)


def test_a_claim_given_up_is_noted_for_its_epoch_until_the_note_expires(leases: Leases) -> None:
    assert not leases.given_up("r1", 3)
    leases.give_up("r1", 3, 0.3)
    assert leases.given_up("r1", 3)
    assert not leases.given_up("r1", 4) and not leases.given_up("r2", 3)
    time.sleep(0.35)
    assert not leases.given_up("r1", 3)


def test_abort_request_reaches_a_handler_registered_by_another_engine(
    leases: Leases, elsewhere: Leases
) -> None:
    handler, received = collector()
    elsewhere.on_abort_request(handler)
    leases.request_abort("run-1")
    assert received.get(timeout=1) == "run-1"


def test_unsubscribed_handler_receives_no_more_aborts(leases: Leases, elsewhere: Leases) -> None:
    gone, gone_received = collector()
    stays, stays_received = collector()
    unsubscribe = elsewhere.on_abort_request(gone)
    elsewhere.on_abort_request(stays)
    unsubscribe()
    leases.request_abort("run-1")
    # Handlers are called in registration order, so `gone` would have had it by now.
    assert stays_received.get(timeout=1) == "run-1"
    assert gone_received.empty()


def test_a_raising_handler_does_not_stop_delivery_to_others(
    leases: Leases, elsewhere: Leases, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(run_id: str) -> None:
        raise RuntimeError("boom")

    handler, received = collector()
    elsewhere.on_abort_request(broken)
    elsewhere.on_abort_request(handler)
    with caplog.at_level(logging.ERROR, logger="agentruns.leases"):
        leases.request_abort("run-1")
        assert received.get(timeout=1) == "run-1"
        leases.request_abort("run-2")
        assert received.get(timeout=1) == "run-2"
    assert any("abort handler" in record.getMessage() for record in caplog.records)


# Redis only: what the in-process implementation cannot do.

HOLDER = textwrap.dedent(
    """
    import sys
    from agentruns.leases import RedisLeases

    leases = RedisLeases({url!r}, prefix={prefix!r})
    assert leases.acquire("run-1", "other-process", {ttl!r})
    print("held", flush=True)
    sys.stdin.read()  # hold until the parent closes our stdin
    leases.release("run-1", "other-process")
    leases.close()
    """
)


def hold_in_another_process(prefix: str, ttl: float) -> subprocess.Popen[str]:
    code = HOLDER.format(url=REDIS_URL, prefix=prefix, ttl=ttl)
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_lease_held_by_another_process_blocks_acquisition_until_released(
    prefix: str,
) -> None:
    leases = RedisLeases(REDIS_URL, prefix=prefix)
    child = hold_in_another_process(prefix, ttl=30)
    try:
        assert not leases.acquire("run-1", "this-process", 5)
        assert leases.holder("run-1") == "other-process"
        assert not leases.renew("run-1", "this-process", 5)
        assert not leases.release("run-1", "this-process")
    finally:
        child.communicate(timeout=10)
    assert child.returncode == 0
    assert leases.acquire("run-1", "this-process", 5)
    leases.close()


def test_a_lease_of_a_killed_process_frees_after_its_ttl(prefix: str) -> None:
    leases = RedisLeases(REDIS_URL, prefix=prefix)
    child = hold_in_another_process(prefix, ttl=0.5)
    child.kill()
    child.communicate(timeout=10)
    assert not leases.acquire("run-1", "this-process", 5)
    time.sleep(0.6)
    assert leases.acquire("run-1", "this-process", 5)
    leases.close()


def test_abort_listener_resubscribes_after_its_connection_is_killed(prefix: str) -> None:
    name = f"{prefix}-listener"
    listening = RedisLeases(prefix=prefix, client=redis.Redis.from_url(REDIS_URL, client_name=name))
    publishing = RedisLeases(REDIS_URL, prefix=prefix)
    admin = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    handler, received = collector()
    listening.on_abort_request(handler)

    killed = [c["id"] for c in admin.client_list(_type="pubsub") if c["name"] == name]
    assert killed
    for client_id in killed:
        admin.client_kill_filter(_id=client_id)

    # Aborts published while it reconnects are lost, so keep asking.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        publishing.request_abort("run-1")
        try:
            assert received.get(timeout=0.2) == "run-1"
            break
        except queue.Empty:
            continue
    else:
        pytest.fail("the listener did not come back within 5 s")
    for made in (listening, publishing):
        made.close()
    admin.close()


def test_the_abort_listener_says_an_outage_once_and_that_it_is_back(
    private_redis: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # It said "abort listener lost Redis" every 2 s for as long as Redis was down,
    # in every process, and never that it was back.
    leases = RedisLeases(private_redis.url)
    handler, _ = collector()
    leases.on_abort_request(handler)
    caplog.set_level(logging.WARNING, logger="agentruns.leases.redis")
    private_redis.kill()
    time.sleep(5)  # retries at 0.1, 0.2, 0.4, 0.8, 1.6, 2 s...
    private_redis.start()
    said = lambda: [r.getMessage() for r in caplog.records]  # noqa: E731
    wait_for(lambda: "abort listener reconnected to Redis" in said() or None, "the reconnect")
    lost = [m for m in said() if m.startswith("abort listener lost Redis")]
    assert len(lost) == 1, said()
    # In one line, naming the error: its traceback was about 75 lines of redis-py.
    (record,) = [r for r in caplog.records if r.getMessage().startswith("abort listener lost")]
    assert record.exc_info is None and "ConnectionError" in record.getMessage()
    leases.close()


def test_commands_against_an_unreachable_redis_raise_redis_errors(prefix: str) -> None:
    leases = RedisLeases("redis://127.0.0.1:1/0", prefix=prefix)  # constructing connects nowhere
    started = time.monotonic()
    with pytest.raises(redis.RedisError):
        leases.acquire("run-1", "a", 5)
    with pytest.raises(redis.RedisError):
        leases.renew("run-1", "a", 5)
    with pytest.raises(redis.RedisError):
        leases.release("run-1", "a")
    assert time.monotonic() - started < 5
    leases.close()


def test_close_stops_the_abort_listener(prefix: str) -> None:
    leases = RedisLeases(REDIS_URL, prefix=prefix)
    leases.on_abort_request(lambda run_id: None)
    leases.close()
    assert not [t for t in threading.enumerate() if t.name.endswith(f"[{prefix}]")]


class _Execution:
    """What the keeper holds of an execution: its run and how to abort it."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.epoch = 1
        self.reason: object = None
        self.aborted: list[object] = []

    def abort(self, reason: object) -> None:
        self.aborted.append(reason)
        self.reason = reason


def test_a_cancel_heard_before_its_run_is_kept_aborts_it_within_a_lease_ttl_only() -> None:
    # Every engine hears every cancel; one for a run it is about to keep must still
    # reach it, and the others are forgotten after a lease TTL, oldest first.
    from agentruns.execution import Abort
    from agentruns.keeper import LeaseKeeper

    keeper = LeaseKeeper(LocalLeases(), None, "me", 0.2, lambda exc: None, lambda run, epoch: None)  # type: ignore[arg-type]
    try:
        for n in range(1000):
            keeper.abort(f"elsewhere-{n}", Abort.CANCEL)
        keeper.abort("soon", Abort.CANCEL)
        soon = _Execution("soon")
        keeper.keep(soon, None, time.monotonic())  # type: ignore[arg-type]
        assert soon.aborted[:1] == [Abort.CANCEL]
        keeper.release("soon")
        keeper.abort("late", Abort.CANCEL)
        time.sleep(0.3)
        keeper.abort("other", Abort.CANCEL)  # forgets those older than the TTL here
        late = _Execution("late")
        keeper.keep(late, None, time.monotonic())  # type: ignore[arg-type]
        assert Abort.CANCEL not in late.aborted  # (its lease, never taken, may be "lost")
    finally:
        keeper.stop()


def test_claims_let_go_are_noted_though_every_renewal_is_stuck_on_the_store() -> None:
    # Postgres gone silent under open connections: five renewals stuck on it held all
    # of the pool's threads, and the notes that the live engine let the runs go, queued
    # behind them, were never written (recover took each run for lost with its worker).
    from agentruns.keeper import LeaseKeeper

    silent = threading.Event()

    class SilentStore:
        def renew_claim(self, run_id: str, epoch: int, expires_at: object) -> bool:
            silent.wait(30)  # a statement to a server gone silent
            return False

        def cancels_requested(self, run_ids: list[str]) -> set[str]:
            return set()

    noted: list[str] = []
    leases = LocalLeases()
    keeper = LeaseKeeper(
        leases,
        SilentStore(),
        "me",
        0.6,
        lambda exc: None,
        lambda run_id, epoch: noted.append(run_id),  # type: ignore[arg-type]
    )
    try:
        runs = [f"r{n}" for n in range(5)]
        for run_id in runs:
            assert leases.acquire(run_id, "me", 0.6)
            keeper.keep(_Execution(run_id), None, time.monotonic())  # type: ignore[arg-type]
        wait_for(lambda: sorted(noted) == runs, "every run's note", timeout=5)
    finally:
        silent.set()
        keeper.stop()
