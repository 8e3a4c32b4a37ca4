"""Settings and what an engine built from them refuses; the event publisher's shutdown."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agentruns import Engine, LocalLeases, RedisLeases, SqlStore
from agentruns.broadcast import EventPublisher
from agentruns.celery import defaults
from agentruns.errors import AgentrunsError, InvalidSettingError
from agentruns.settings import Settings, get_settings
from agentruns.wiring import engine_from_settings
from tests.conftest import REDIS_URL

ROOT = Path(__file__).resolve().parent.parent


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


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_queue_name_is_refused(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Workers consumed a queue named "", and producers' dispatches were lost unsaid.
    monkeypatch.setenv("AGENTRUNS_QUEUE", value)
    with pytest.raises(ValidationError, match="queue's name must not be empty"):
        Settings()


def test_a_bad_setting_is_named_in_one_line_by_engines_workers_and_beat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Engine.from_settings() raised pydantic's multi-line text naming the field
    # (lease_ttl), not the variable; a worker or beat ended on the same.
    said = (
        "invalid setting AGENTRUNS_LEASE_TTL: Input should be a valid number,"
        " unable to parse string as a number"
    )
    monkeypatch.setenv("AGENTRUNS_LEASE_TTL", "abc")
    get_settings.cache_clear()  # read by an earlier test
    try:
        with pytest.raises(InvalidSettingError) as err:
            Engine.from_settings()
    finally:
        get_settings.cache_clear()
    assert str(err.value) == said and isinstance(err.value, ValueError)
    env = {**os.environ, "AGENTRUNS_LEASE_TTL": "abc", "PYTHONPATH": str(ROOT)}
    for command in (["worker", "-P", "solo", "-n", "bad-setting@%h"], ["beat"]):
        started = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "agentruns", *command],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        # Celery's command line says it in one line, as agentruns' own does (exit 2);
        # it printed a whole traceback, ending on the exception's name.
        assert started.returncode == 2, started.stderr[-2000:]
        assert started.stderr.strip() == f"Error: {said}", started.stderr[-2000:]


def test_an_engine_refuses_lease_and_requeue_times_that_are_not_finite(sqlite_url: str) -> None:
    for times in (
        {"lease_ttl": float("inf")},
        {"lease_ttl": float("nan")},
        {"requeue_after": 1e12},
    ):
        with pytest.raises(ValueError, match="lease_ttl and requeue_after"):
            Engine(SqlStore(sqlite_url), leases=LocalLeases(), secret="s", **times)


def test_an_engine_refuses_options_it_cannot_work_with_before_anything_runs(
    db_url: str,
) -> None:
    # On Postgres, an owner over 200 characters (or holding NUL) failed every claim,
    # each dispatched run left queued and said only as "execution failed" in the log
    # (SQLite took it); a bytes secret left every approval waiting with no token;
    # 10^7 slots made close() take 34 s; "30" for lease_ttl raised a bare TypeError.
    store = SqlStore(db_url)
    try:
        for options, error, said in (
            ({"owner": "o" * 201}, ValueError, "owner must be UTF-8 text of 1 to 200"),
            ({"owner": "pod\x00x"}, ValueError, "without NUL"),
            ({"owner": ""}, ValueError, "owner must be"),
            ({"owner": 5}, ValueError, "owner must be"),
            ({"secret": b"key"}, TypeError, "secret must be text .str., not bytes"),
            ({"secret": 5}, TypeError, "secret must be text"),
            ({"slots": 10**7}, ValueError, "slots must be a whole number from 1 to 10000"),
            ({"slots": True}, ValueError, "slots must be a whole number"),
            ({"slots": 2.5}, ValueError, "slots must be a whole number"),
            ({"lease_ttl": "30"}, ValueError, "lease_ttl and requeue_after must be seconds"),
        ):
            with pytest.raises(error, match=said):
                Engine(store, leases=LocalLeases(), **{"secret": "s", **options})
        with pytest.raises(ValidationError, match="less than or equal to 10000"):
            Settings(slots=10**7)
        Engine(store, leases=LocalLeases(), secret="s", owner="o" * 200, slots=10_000).close()
    finally:
        store.close()


def test_an_engine_built_for_several_processes_needs_their_shared_secret(sqlite_url: str) -> None:
    settings = Settings(database_url=sqlite_url, redis_url=REDIS_URL, agents="")
    with pytest.raises(AgentrunsError, match="AGENTRUNS_SECRET is not set"):
        engine_from_settings(settings)
    engine_from_settings(settings.model_copy(update={"secret": "shared"})).close()
    # Built directly, an engine with RedisLeases started with a secret of its own:
    # a token it minted failed in the worker or web process that answered it.
    leases = RedisLeases(REDIS_URL, prefix=f"secret-{os.getpid()}")
    with pytest.raises(ValueError, match="secret is required with RedisLeases"):
        Engine(SqlStore(sqlite_url), leases=leases)
    Engine(SqlStore(sqlite_url), leases=leases, secret="shared").close()
    with pytest.warns(UserWarning, match="only be valid in this process"):
        Engine(SqlStore(sqlite_url), leases=LocalLeases()).close()  # one process: it may


def test_an_empty_secret_is_unset_in_settings_and_refused_by_an_engine(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An empty HMAC key would sign tokens that anyone who reads a waiting run can forge.
    monkeypatch.setenv("AGENTRUNS_SECRET", "")
    assert Settings().secret is None
    with pytest.raises(ValueError, match="secret must not be empty"):
        Engine(SqlStore(sqlite_url), leases=LocalLeases(), secret="")
    settings = Settings(database_url=sqlite_url, redis_url=REDIS_URL, agents="")
    with pytest.raises(AgentrunsError, match="AGENTRUNS_SECRET is not set"):
        engine_from_settings(settings)


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


CONF_PROBE = """
import json
from agentruns.celery import app
names = ["worker_prefetch_multiplier", "task_time_limit", "broker_url", "task_acks_late"]
conf = {n: app.conf[n] for n in names}
conf["queues"] = [q.name for q in app.conf.task_queues]
conf["recover_queue"] = app.conf.task_routes["agentruns.recover"]["queue"]
print(json.dumps(conf))
"""


def _beside_celeryconfig(
    tmp_path: Path, lines: list[str], code: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -c code`` in a process with this celeryconfig.py beside it."""
    (tmp_path / "celeryconfig.py").write_text("\n".join(lines) + "\n")
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={
            **os.environ,
            "AGENTRUNS_DATABASE_URL": "sqlite:///x.db",
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


def _probe_celeryconfig(tmp_path: Path, lines: list[str]) -> dict[str, Any]:
    """The Celery configuration a process gets with this celeryconfig.py beside it."""
    out = _beside_celeryconfig(tmp_path, lines, CONF_PROBE).stdout
    conf: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return conf


@pytest.mark.parametrize("override", [True, False])
def test_a_celeryconfig_overrides_agentruns_defaults_and_keeps_the_rest(
    tmp_path: Path, override: bool
) -> None:
    # Celery ranks add_defaults() above the config module: without care, a
    # celeryconfig.py could not override one of agentruns' settings.
    lines = ['broker_url = "redis://127.0.0.1:6379/7"']
    if override:
        lines += ["worker_prefetch_multiplier = 4", "task_time_limit = 123"]
        lines += ['task_default_queue = "custom"']
    conf = _probe_celeryconfig(tmp_path, lines)
    ours = defaults()
    assert conf["broker_url"] == "redis://127.0.0.1:6379/7"
    assert conf["task_acks_late"] is True  # agentruns' at-least-once settings stay
    if override:
        assert (conf["worker_prefetch_multiplier"], conf["task_time_limit"]) == (4, 123)
        # Workers consume the deployment's queue, and its sweeps queue, not ours.
        assert conf["queues"] == ["custom", "custom.sweeps"]
        assert conf["recover_queue"] == "custom.sweeps"
    else:
        assert conf["worker_prefetch_multiplier"] == ours["worker_prefetch_multiplier"]
        assert conf["task_time_limit"] == ours["task_time_limit"]


@pytest.mark.parametrize(
    "lines",
    [
        # The deployment routes its own tasks too.
        ['task_default_queue = "custom"', 'task_routes = {"myapp.*": {"queue": "other"}}'],
        ['CELERY_DEFAULT_QUEUE = "custom"'],  # Celery's old-style name
    ],
)
def test_workers_consume_the_queue_a_celeryconfig_sends_to(
    tmp_path: Path, lines: list[str]
) -> None:
    conf = _probe_celeryconfig(tmp_path, lines)
    assert conf["queues"] == ["custom", "custom.sweeps"]
    assert conf["recover_queue"] == "custom.sweeps"


def test_a_broker_or_queue_other_than_the_environment_names_is_said(tmp_path: Path) -> None:
    # A team's own celeryconfig.py in the working directory, or Celery's own
    # CELERY_BROKER_URL, silently sent agentruns' messages elsewhere.
    env = {
        "AGENTRUNS_BROKER_URL": "redis://127.0.0.1:6379/13",
        "AGENTRUNS_QUEUE": "ours",
        "CELERY_BROKER_URL": "redis://:hunter2@127.0.0.1:6379/14",
    }
    probe = "from agentruns.celery import app; app.conf.task_default_queue"
    said = _beside_celeryconfig(tmp_path, ['task_default_queue = "team_q"'], probe, env).stderr
    assert "the Celery broker is redis://:**@127.0.0.1:6379/14, set by CELERY_BROKER_URL" in said
    assert "not redis://127.0.0.1:6379/13 from AGENTRUNS_BROKER_URL" in said
    assert "the Celery queue is 'team_q', set by celeryconfig (" in said
    assert "hunter2" not in said


SCHEDULE_PROBE = """
import json
from agentruns.celery import app
print(json.dumps({name: entry["schedule"] for name, entry in app.conf.beat_schedule.items()}))
"""


@pytest.mark.parametrize("name", ["beat_schedule", "CELERYBEAT_SCHEDULE"])  # Celery's old name too
def test_a_celeryconfigs_beat_schedule_adds_to_the_sweeps(tmp_path: Path, name: str) -> None:
    # A team's own periodic task replaced beat's whole schedule: no tick and no
    # recover, so crashed runs were never recovered and approvals never expired.
    lines = [
        f"{name} = {{",
        '    "nightly-report": {"task": "myproj.report", "schedule": 3600.0},',
        '    "agentruns.recover": {"task": "agentruns.recover", "schedule": 60.0},',
        "}",
    ]
    out = _beside_celeryconfig(tmp_path, lines, SCHEDULE_PROBE).stdout
    schedule = json.loads(out.strip().splitlines()[-1])
    tick = defaults()["beat_schedule"]["agentruns.tick"]["schedule"]
    # Its entry of the same name as one of ours replaces ours.
    assert schedule == {"nightly-report": 3600.0, "agentruns.tick": tick, "agentruns.recover": 60.0}


ROUTE_PROBE = """
import json
from agentruns.celery import app
tasks = ["agentruns.dispatch", "agentruns.execute", "agentruns.tick", "agentruns.recover",
         "agentruns.cancel"]
routed = {t: app.amqp.router.route({}, t, (), {})["queue"].name for t in tasks}
print(json.dumps({**routed, "transport": app.conf.broker_transport}))
"""


@pytest.mark.parametrize(
    ("routes", "tick", "recover"),
    [
        # A glob: the sweeps went to default.sweeps, which a worker `-Q agents` never reads.
        ('{"agentruns.*": {"queue": "agents"}}', "agents", "agents"),
        # An exact name, to a queue of the deployment's own (not in task_queues).
        ('{"agentruns.tick": {"queue": "ops"}}', "ops", "default.sweeps"),
        # A list of routers that leaves the sweeps alone: ours.
        ('[{"agentruns.dispatch": "agents"}]', "default.sweeps", "default.sweeps"),
        # A list that routes them: as it says (merged into a dict, it raised, and the
        # configuration's later steps, the broker's transport among them, were skipped).
        ('[{"agentruns.*": {"queue": "agents"}}]', "agents", "agents"),
    ],
)
def test_a_celeryconfigs_routes_decide_where_the_sweeps_go_where_they_match(
    tmp_path: Path, routes: str, tick: str, recover: str
) -> None:
    lines = ['task_default_queue = "default"', f"task_routes = {routes}"]
    out = _beside_celeryconfig(tmp_path, lines, ROUTE_PROBE).stdout
    queues = json.loads(out.strip().splitlines()[-1])
    assert (queues["agentruns.tick"], queues["agentruns.recover"]) == (tick, recover)
    assert queues["agentruns.cancel"] == recover  # ahead of the runs' backlog, as the sweeps
    assert queues["transport"] == "agentruns.broker:Transport"
    assert queues["agentruns.execute"] == ("agents" if "agentruns.*" in routes else "default")
