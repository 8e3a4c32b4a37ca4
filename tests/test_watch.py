"""`agentruns watch` follows runs live over Redis pub/sub when Redis is configured."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from agentruns import (
    Agent,
    Engine,
    FatalToolError,
    LocalLeases,
    RedisLeases,
    Run,
    RunStatus,
    SqlStore,
    tool,
)
from agentruns.broadcast import EventPublisher, channel, subscribe, summary
from agentruns.cli import watch
from agentruns.cli.session import Session
from agentruns.cli.watch import _Follower, _runs, _wakeups
from agentruns.events import Event
from agentruns.models import ScriptedModel, text, tool_use
from agentruns.schedulers import ManualScheduler
from agentruns.settings import Settings
from agentruns.store import schema, sql
from agentruns.wiring import engine_from_settings
from tests.conftest import REDIS_URL, database_away, free_port, trigger
from tests.support.private_redis import PrivateRedis

ROOT = Path(__file__).resolve().parent.parent


def _manual_engine(url: str, agent: Agent | None = None) -> Engine:
    """An engine whose runs execute only when the test says (agent "a" answers "ok")."""
    return Engine(
        SqlStore(url),
        leases=LocalLeases(),
        scheduler=ManualScheduler(),
        agents=[agent or Agent("a", ScriptedModel([text("ok")]))],
        secret="s",
    )


def test_watch_wakes_on_published_events_instead_of_waiting_for_its_poll(
    sqlite_url: str,
) -> None:
    settings = Settings(database_url=sqlite_url, redis_url=REDIS_URL, agents="", secret="s")
    engine = engine_from_settings(
        settings,
        agents=[Agent("a", ScriptedModel([text("ok")], latency_s=0.2))],
        scheduler=ManualScheduler(),
        leases=RedisLeases(REDIS_URL, prefix=f"watch-{os.getpid()}"),
    )
    run = engine.dispatch("a", trigger({}))
    env = {
        **os.environ,
        "AGENTRUNS_DATABASE_URL": sqlite_url,
        "AGENTRUNS_REDIS_URL": REDIS_URL,
        "PYTHONPATH": str(ROOT),
    }
    # A poll interval far longer than the test: only a published event can wake it.
    watcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentruns.cli",
            "--json",
            "watch",
            "--run",
            run.id,
            "--until-final",
            "--interval",
            "60",
        ],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert watcher.stdout is not None
        first = json.loads(watcher.stdout.readline())
        assert first["event"] == "run.updated" and first["run"]["status"] == "queued"
        time.sleep(1.0)  # let it subscribe, and the publisher see it
        started = time.monotonic()
        assert engine.execute(run.id).status is RunStatus.COMPLETED
        out, _ = watcher.communicate(timeout=15)
        assert time.monotonic() - started < 15
        events = [json.loads(line) for line in out.splitlines()]
        assert events[-1]["event"] == "run.updated"
        assert events[-1]["run"]["status"] == "completed"
        assert any(e["event"] == "step.appended" for e in events)
        assert watcher.returncode == 0
    finally:
        if watcher.poll() is None:
            watcher.kill()
        engine.close()


def test_watch_outlives_the_database_going_away_for_a_while(db_url: str) -> None:
    # A watch is meant to run for long: one failed read (a restart, a killed
    # backend) ended it with "database error ... terminating connection".
    engine = _manual_engine(db_url)
    run = engine.dispatch("a", trigger({}))
    env = {**os.environ, "AGENTRUNS_DATABASE_URL": db_url, "PYTHONPATH": str(ROOT)}
    env.pop("AGENTRUNS_REDIS_URL", None)
    argv = ["--json", "watch", "--run", run.id, "--until-final", "--interval", "0.2"]
    watcher = subprocess.Popen(
        [sys.executable, "-m", "agentruns.cli", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert watcher.stdout is not None
        first = json.loads(watcher.stdout.readline())
        assert first["run"]["status"] == "queued"
        with database_away(db_url):
            time.sleep(0.6)  # a look or two meets the server away
        assert engine.execute(run.id).status is RunStatus.COMPLETED
        out, err = watcher.communicate(timeout=15)
        assert watcher.returncode == 0, err
        assert json.loads(out.splitlines()[-1])["run"]["status"] == "completed"
        assert "cannot read the database" in err and "reading the database again" in err
        assert "Traceback" not in err
    finally:
        if watcher.poll() is None:
            watcher.kill()
        engine.close()


def test_watch_looks_on_a_clock_when_redis_goes_away(
    sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The subscription's error ended the watch; the store stays the truth without it.
    session = Session(as_json=True)
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    session._settings = Settings(database_url=sqlite_url, redis_url=nowhere, agents="")
    wakeups = _wakeups(session, 0.01)
    assert [next(wakeups), next(wakeups)] == [None, None]
    assert "lost Redis's events" in capsys.readouterr().err


def test_watch_takes_redis_events_again_once_redis_is_back(
    sqlite_url: str, private_redis: PrivateRedis, capsys: pytest.CaptureFixture[str]
) -> None:
    # A watch that lost Redis looked on its clock for as long as it ran, however soon
    # Redis came back: a long poll interval then meant late lines.
    session = Session(as_json=True)
    session._settings = Settings(database_url=sqlite_url, redis_url=private_redis.url, agents="")
    wakeups = _wakeups(session, 0.05)
    assert next(wakeups) == []  # subscribed
    private_redis.kill()
    while "lost Redis's events" not in capsys.readouterr().err:
        assert next(wakeups) is None
    private_redis.start()
    publisher = redis.Redis.from_url(private_redis.url)
    for _ in range(200):  # at most about 10 s of wake-ups
        if next(wakeups) == [] and publisher.pubsub_numsub(channel(publisher, "agentruns"))[0][1]:
            break
    else:
        raise AssertionError("the watch did not subscribe again")
    assert "receiving Redis's events again" in capsys.readouterr().err
    publisher.publish(
        channel(publisher, "agentruns"), json.dumps({"type": "run.updated", "run_id": "r"})
    )
    assert next(wakeups) == [{"type": "run.updated", "run_id": "r"}]


def test_a_look_whose_read_fails_leaves_its_runs_to_the_next_look(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A watch now outlives a failed read, but the look had noted the run as shown
    # before it read the steps: every later look skipped it, its completion was
    # never printed, and --until-final never ended.
    @tool
    def search() -> str:
        """Search."""
        return "found"

    model = ScriptedModel([tool_use("search", {}), text("done")])
    engine = _manual_engine(sqlite_url, Agent("a", model, tools=[search]))
    try:
        out = io.StringIO()
        follower = _Follower(Session(as_json=False, out=out), engine, history=False)
        run = engine.dispatch("a", trigger({}))
        follower.poll([engine.get_run(run.id)], baseline=True)
        assert engine.execute(run.id).status is RunStatus.COMPLETED
        steps = engine.store.steps

        def gone(run_id: str, start: int = 0) -> Any:
            raise sa.exc.OperationalError("SELECT", {}, Exception("connection gone"))

        monkeypatch.setattr(engine.store, "steps", gone)
        with pytest.raises(sa.exc.OperationalError):
            follower.poll([engine.get_run(run.id)], baseline=False)
        monkeypatch.setattr(engine.store, "steps", steps)
        follower.poll([engine.get_run(run.id)], baseline=False)
        assert follower.settled()
        lines = out.getvalue().splitlines()
        shown = [line.split()[1:4] for line in lines]
        assert [s[2].rstrip(":") for s in shown if s[0] == "run"] == ["queued", "completed"], lines
        assert len([s for s in shown if s[0] != "run"]) == 3, lines  # llm, tool, llm
    finally:
        engine.close()


def test_a_running_event_that_comes_after_a_later_look_is_not_shown(sqlite_url: str) -> None:
    # The engine publishes a "running" event after each step; a watcher whose look
    # at the store is ahead of them must not print the run as running again.
    @tool(needs_approval=True)
    def post(body: str) -> str:
        """Post."""
        return "posted"

    @tool
    def search() -> str:
        """Search."""
        return "found"

    model = ScriptedModel([tool_use("search", {}), tool_use("post", {"body": "hi"})])

    engine = _manual_engine(sqlite_url, Agent("a", model, tools=[search, post]))
    try:
        published: list[dict[str, object]] = []
        engine.on("run.updated", lambda event: published.append(summary(event)))
        out = io.StringIO()
        follower = _Follower(Session(as_json=False, out=out), engine, history=False)
        run = engine.dispatch("a", trigger({}))
        follower.poll([engine.get_run(run.id)], baseline=True)
        assert engine.execute(run.id).status is RunStatus.WAITING
        running = [e for e in published if e["status"] == "running"]
        assert len(running) >= 2  # one per step

        follower.heard(running[0])  # the first wakes the watcher: its look sees waiting
        follower.poll([engine.get_run(run.id)], baseline=False)
        for event in running[1:]:  # the rest arrive after that look
            follower.heard(event)
            follower.poll([engine.get_run(run.id)], baseline=False)
        engine.cancel(run.id)
        follower.poll([engine.get_run(run.id)], baseline=False)

        lines = out.getvalue().splitlines()
        shown = [line.split()[3] for line in lines if line.split()[1] == "run"]
        assert shown == ["queued", "running", "waiting", "cancelled"], lines
    finally:
        engine.close()


def test_a_watch_looks_at_the_store_once_it_is_subscribed_again(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Events published while it was not subscribed (Redis away) are gone: a watch
    # subscribed again must look for what they said. (Its wake-ups are given here:
    # the confirmation of a subscription is an empty batch; see the test above.)
    import agentruns.cli.watch as watching

    engine = _manual_engine(sqlite_url)
    session = Session(as_json=True, out=io.StringIO())
    session._settings = Settings(database_url=sqlite_url, agents="")
    session._engine = engine
    looks: list[int] = []
    real_runs = watching._runs

    def runs(engine: Engine, run_id: str | None) -> list[Any]:
        looks.append(1)
        return real_runs(engine, run_id)

    def wakeups(session: Session, interval: float) -> Any:
        yield []  # subscribed again
        raise KeyboardInterrupt

    monkeypatch.setattr(watching, "_runs", runs)
    monkeypatch.setattr(watching, "_wakeups", wakeups)
    try:
        assert watching.watch(session, run_id=None, until_final=False, interval=60) == 0
        assert len(looks) == 2  # the first look, and one on subscribing
    finally:
        engine.close()


def test_a_watcher_forgets_settled_runs_that_left_its_window(sqlite_url: str) -> None:
    # A watcher left running for months kept an entry per run it ever saw, and one
    # per run of another deployment it heard start.
    engine = _manual_engine(sqlite_url)
    try:
        follower = _Follower(Session(as_json=True, out=io.StringIO()), engine, history=False)
        runs = [engine.dispatch("a", trigger({})) for _ in range(3)]
        follower.poll(runs, baseline=True)
        for run in runs:
            engine.execute(run.id)
        follower.poll([engine.get_run(r.id) for r in runs], baseline=False)
        follower.heard({"run_id": "elsewhere", "status": "running"})
        later = engine.dispatch("a", trigger({}))
        follower.poll([engine.get_run(later.id)], baseline=False)  # the others left
        assert set(follower.status) == set(follower.updated) == set(follower.steps) == {later.id}
        assert follower.started == {}
    finally:
        engine.close()


def test_a_watchers_look_reads_in_full_only_the_runs_whose_status_it_shows(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each look (each batch of events) read up to 1000 runs of each active status in
    # full, tool inputs of wait points and all: 1000 runs waiting on 100 KB inputs
    # took 0.25 s and 300 MB per look.
    engine = _manual_engine(sqlite_url)
    try:
        out = io.StringIO()
        follower = _Follower(Session(as_json=False, out=out), engine, history=False)
        runs = [engine.dispatch("a", trigger({})) for _ in range(3)]
        follower.poll(_runs(engine, None), baseline=True)
        read: list[str] = []
        run_from_row = sql.run_from_row

        def reading(row: Any) -> Run:
            read.append(row["id"])
            return run_from_row(row)

        monkeypatch.setattr(sql, "run_from_row", reading)
        follower.poll(_runs(engine, None), baseline=False)
        assert read == []  # nothing changed
        engine.execute(runs[0].id)
        read.clear()
        follower.poll(_runs(engine, None), baseline=False)
        assert read == [runs[0].id]
        lines = [line.split() for line in out.getvalue().splitlines()]
        shown = [(words[2], words[3].rstrip(":")) for words in lines if words[1] == "run"]
        assert shown == [*((r.id, "queued") for r in runs), (runs[0].id, "completed")], lines
    finally:
        engine.close()


def test_events_and_aborts_stay_within_their_redis_database() -> None:
    # Redis' pub/sub is one for the whole server: a deployment on its database 1
    # (staging) heard every event and abort of one on database 0, and its workers
    # made events for the other's watchers.
    here, there = REDIS_URL, REDIS_URL.rsplit("/", 1)[0] + "/1"
    prefix = f"scoped-{os.getpid()}"
    wakeups = subscribe(here, prefix=prefix, timeout=0.2)
    aborts: list[str] = []
    own, other = RedisLeases(here, prefix=prefix), RedisLeases(there, prefix=prefix)
    publisher = EventPublisher(there, prefix=prefix)
    try:
        assert next(wakeups) == []  # subscribed
        own.on_abort_request(aborts.append)
        time.sleep(EventPublisher.LOOK_EVERY_S * 3)
        assert not publisher.wanted()  # the watcher is another database's
        other.request_abort("run-there")
        own.request_abort("run-here")
        wait = time.monotonic() + 5
        while not aborts and time.monotonic() < wait:
            time.sleep(0.02)
        time.sleep(0.2)
        assert aborts == ["run-here"]
    finally:
        wakeups.close()
        publisher.close()
        own.close()
        other.close()


def test_events_that_arrive_together_are_read_in_one_wakeup() -> None:
    # A watcher looked at the store once per event, fell behind a busy deployment,
    # and its unread events piled up in Redis.
    prefix = f"watch-batch-{os.getpid()}"
    wakeups = subscribe(REDIS_URL, prefix=prefix, timeout=0.2)
    try:
        assert next(wakeups) == []  # subscribed
        assert next(wakeups) is None  # quiet
        publisher = redis.Redis.from_url(REDIS_URL)
        for i in range(50):
            publisher.publish(channel(publisher, prefix), json.dumps({"run_id": str(i)}))
        publisher.publish(channel(publisher, prefix), "not json")
        publisher.close()
        time.sleep(0.3)
        batch = next(wakeups)
        assert batch is not None and [e["run_id"] for e in batch] == [str(i) for i in range(50)]
    finally:
        wakeups.close()


def test_what_a_short_command_did_is_published_before_it_exits(sqlite_url: str) -> None:
    # `agentruns cancel` made its event before its publisher's first look (none, then)
    # or queued it just before its close (dropped): a watcher missed about one in three.
    prefix = f"watch-short-{os.getpid()}"
    wakeups = subscribe(REDIS_URL, prefix=prefix, timeout=0.2)
    engine = _manual_engine(sqlite_url)
    try:
        assert next(wakeups) == []  # subscribed
        runs = [engine.dispatch("a", trigger({"n": i})) for i in range(10)]
        for run in runs:  # a command each: a publisher made, used at once and closed
            publisher = EventPublisher(REDIS_URL, prefix=prefix)
            publisher(Event("run.updated", run=engine.cancel(run.id)))
            publisher.close()
        heard: list[dict[str, object]] = []
        deadline = time.monotonic() + 5
        while len(heard) < len(runs) and time.monotonic() < deadline:
            heard += next(wakeups) or []
        assert [(e["run_id"], e["status"]) for e in heard] == [(r.id, "cancelled") for r in runs]
    finally:
        wakeups.close()
        engine.close()


def test_a_worker_makes_no_events_while_nobody_watches(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker's publisher listens to every write and drops the events while no
    # watcher is subscribed: each write still made its steps and events for it.
    built: list[int] = []
    new_steps = sql.new_steps

    def counted(*args: Any) -> Any:
        steps = new_steps(*args)
        built.append(len(steps))
        return steps

    monkeypatch.setattr(sql, "new_steps", counted)
    prefix = f"watch-wanted-{os.getpid()}"
    publisher = EventPublisher(REDIS_URL, prefix=prefix)
    engine = _manual_engine(sqlite_url)
    engine.on("run.updated", publisher)
    engine.on("step.appended", publisher)
    wakeups = None
    try:
        time.sleep(2 * EventPublisher.LOOK_EVERY_S)
        unwatched = engine.dispatch("a", trigger({"n": 1}))
        assert engine.execute(unwatched.id).status is RunStatus.COMPLETED
        assert built == []

        wakeups = subscribe(REDIS_URL, prefix=prefix, timeout=0.2)
        assert next(wakeups) == []  # subscribed
        time.sleep(2 * EventPublisher.LOOK_EVERY_S)  # the publisher sees a watcher
        watched = engine.dispatch("a", trigger({"n": 2}))
        assert engine.execute(watched.id).status is RunStatus.COMPLETED
        assert built == [1]
        heard: list[dict[str, object]] = []
        deadline = time.monotonic() + 5
        while not any(e.get("type") == "step.appended" for e in heard):
            assert time.monotonic() < deadline, heard
            heard += next(wakeups) or []
        assert {e["run_id"] for e in heard} == {watched.id}
    finally:
        if wakeups is not None:
            wakeups.close()
        engine.close()
        publisher.close()


def _pushed_out(engine: Engine) -> None:
    """Newer runs, settled, enough to push every older run out of a look's window."""
    for _ in range(100):
        engine.cancel(engine.dispatch("a", trigger({}), schedule=False).id)


def _shown(out: io.StringIO, run_id: str) -> list[str | int]:
    """What a JSON watch said of one run: its statuses, and its steps' indexes."""
    said: list[str | int] = []
    for line in out.getvalue().splitlines():
        event = json.loads(line)
        if event.get("run", {}).get("id") == run_id:
            said.append(event["run"]["status"])
        elif event.get("step", {}).get("run_id") == run_id:
            said.append(event["step"]["index"])
    return said


def test_a_run_that_settles_outside_the_watched_window_is_shown_settled(
    sqlite_url: str,
) -> None:
    # A look reads the 100 newest runs and the active ones: a run that settled once
    # newer runs had pushed it out was never read again. Its last steps and final
    # state were never printed, and --until-final waited for it for ever.
    engine = _manual_engine(sqlite_url)
    try:
        out = io.StringIO()
        follower = _Follower(Session(as_json=True, out=out), engine, history=False)
        run = engine.dispatch("a", trigger({}), schedule=False)
        follower.poll(_runs(engine, None), baseline=True)
        _pushed_out(engine)
        follower.poll(_runs(engine, None), baseline=False)
        assert engine.execute(run.id).status is RunStatus.COMPLETED
        assert run.id not in {r.id for r in _runs(engine, None)}
        follower.poll(_runs(engine, None), baseline=False)
        assert _shown(out, run.id) == ["queued", 0, "completed"]
        assert follower.settled()
        follower.poll(_runs(engine, None), baseline=False)
        assert run.id not in follower.status  # forgotten once shown settled
    finally:
        engine.close()


def test_a_change_an_event_names_is_shown_though_the_run_is_outside_the_window(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A look reads the newest 1,000 runs of each active status: cancelling the oldest
    # of 2,000 waiting runs was never shown, though its event named the run.
    monkeypatch.setattr(watch, "WINDOW", 2)
    engine = _manual_engine(sqlite_url)
    try:
        out = io.StringIO()
        follower = _Follower(Session(as_json=True, out=out), engine, history=False)
        oldest, *newer = [engine.dispatch("a", trigger({}), schedule=False) for _ in range(3)]
        _pushed_out(engine)
        follower.poll(_runs(engine, None), baseline=True)
        assert _shown(out, oldest.id) == []  # outside the window
        assert [_shown(out, run.id) for run in newer] == [["queued"], ["queued"]]
        published: list[dict[str, object]] = []
        engine.on("run.updated", lambda event: published.append(summary(event)))
        engine.cancel(oldest.id)
        for event in published:
            follower.heard(event)
        # A look whose read fails (the database went away), of the runs or of their
        # steps, leaves the name for the next.
        gone = sa.exc.OperationalError("SELECT", {}, Exception("the database is away"))
        for read in ("get_runs", "steps"):
            looked = _runs(engine, None)
            with monkeypatch.context() as away:
                away.setattr(engine.store, read, lambda *args: (_ for _ in ()).throw(gone))
                with pytest.raises(sa.exc.OperationalError):
                    follower.poll(looked, baseline=False)
        follower.poll(_runs(engine, None), baseline=False)
        assert _shown(out, oldest.id) == ["cancelled"]
        follower.heard({"run_id": "another-deployments-run", "status": "completed"})
        follower.poll(_runs(engine, None), baseline=False)  # not found: nothing to show
        assert follower.named == {} and oldest.id not in follower.status
    finally:
        engine.close()


def test_a_look_reads_only_the_steps_it_has_not_shown(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each look read every step of a run whose new steps it showed: following a run
    # of 2,200 steps cost 0.2 s a step, quadratic over the run. And the first look
    # read each active run's steps to count them (the run's row has the count).
    @tool(needs_approval=True)
    def post(body: str) -> str:
        """Post."""
        return "posted"

    @tool
    def search() -> str:
        """Search."""
        return "found"

    script = [tool_use("search", {}), tool_use("search", {}), tool_use("post", {"body": "hi"})]
    model = ScriptedModel([*script, text("done")])
    engine = _manual_engine(sqlite_url, Agent("a", model, tools=[search, post]))
    try:
        out = io.StringIO()
        follower = _Follower(Session(as_json=True, out=out), engine, history=False)
        run = engine.dispatch("a", trigger({}))
        read: list[int] = []
        step_from_row = sql.step_from_row

        def reading(run_id: str, row: Any) -> Any:
            read.append(row["idx"])
            return step_from_row(run_id, row)

        monkeypatch.setattr(sql, "step_from_row", reading)
        follower.poll(_runs(engine, None), baseline=True)
        assert read == []
        assert engine.execute(run.id).status is RunStatus.WAITING
        follower.poll(_runs(engine, None), baseline=False)
        first, read[:] = read[:], []
        waiting = len(engine.steps(run.id))
        assert first == list(range(waiting))
        read.clear()
        engine.resume(engine.approval_token(run.id), approved=True)
        assert engine.execute(run.id).status is RunStatus.COMPLETED
        follower.poll(_runs(engine, None), baseline=False)
        second = read[:]
        total = len(engine.steps(run.id))
        assert second == list(range(waiting, total))
        said = _shown(out, run.id)
        assert [i for i in said if isinstance(i, int)] == list(range(total))
        assert [s for s in said if isinstance(s, str)] == ["queued", "waiting", "completed"]
    finally:
        engine.close()


def _failing_once(url: str) -> Engine:
    """Agent "a" calls a tool that fails the run the first time, then answers "done"."""
    calls: list[int] = []

    @tool
    def flaky() -> str:
        """Flaky."""
        calls.append(1)
        if len(calls) == 1:
            raise FatalToolError("down")
        return "up"

    model = ScriptedModel([tool_use("flaky", {}), text("done")])
    return _manual_engine(url, Agent("a", model, tools=[flaky]))


def test_a_retried_run_back_in_the_window_shows_only_its_new_steps(sqlite_url: str) -> None:
    # A run forgotten once it left the window settled, then retried, was taken for a
    # new one: all its steps were printed again (and, with the run out of the window
    # again, its new final state never).
    engine = _failing_once(sqlite_url)
    try:
        out = io.StringIO()
        follower = _Follower(Session(as_json=True, out=out), engine, history=False)
        run = engine.dispatch("a", trigger({}), schedule=False)
        follower.poll(_runs(engine, None), baseline=True)
        assert engine.execute(run.id).status is RunStatus.FAILED
        follower.poll(_runs(engine, None), baseline=False)
        before = len(engine.steps(run.id))
        _pushed_out(engine)
        follower.poll(_runs(engine, None), baseline=False)
        assert run.id not in follower.status  # forgotten
        engine.retry(run.id)
        follower.poll(_runs(engine, None), baseline=False)
        assert engine.execute(run.id).status is RunStatus.COMPLETED
        follower.poll(_runs(engine, None), baseline=False)
        after = len(engine.steps(run.id))
        assert after > before
        assert _shown(out, run.id) == [
            "queued",
            *range(before),
            "failed",
            "queued",
            *range(before, after),
            "completed",
        ]
    finally:
        engine.close()


@pytest.mark.parametrize("window", ["left it", "in it"])
def test_a_run_settled_before_the_watch_began_shows_only_the_steps_of_its_retry(
    sqlite_url: str, window: str
) -> None:
    # Its steps were not read when the watch began (it had settled): a retry showed
    # them all as if new, whether the run had left the watched window or not.
    engine = _failing_once(sqlite_url)
    try:
        run = engine.dispatch("a", trigger({}), schedule=False)
        assert engine.execute(run.id).status is RunStatus.FAILED
        before = len(engine.steps(run.id))
        if window == "left it":
            _pushed_out(engine)
        out = io.StringIO()
        follower = _Follower(Session(as_json=True, out=out), engine, history=False)
        follower.poll(_runs(engine, None), baseline=True)
        engine.retry(run.id)
        follower.poll(_runs(engine, None), baseline=False)
        assert engine.execute(run.id).status is RunStatus.COMPLETED
        follower.poll(_runs(engine, None), baseline=False)
        after = len(engine.steps(run.id))
        assert _shown(out, run.id) == ["queued", *range(before, after), "completed"]
    finally:
        engine.close()


def test_a_held_run_deleted_by_hand_is_let_go(sqlite_url: str) -> None:
    # Read again by id as it left the look, a deleted run was held unsettled for ever.
    engine = _manual_engine(sqlite_url)
    try:
        follower = _Follower(Session(as_json=True, out=io.StringIO()), engine, history=False)
        run = engine.dispatch("a", trigger({}), schedule=False)
        follower.poll(_runs(engine, None), baseline=True)
        assert not follower.settled()
        with sa.create_engine(sqlite_url).begin() as conn:
            conn.execute(schema.runs.delete().where(schema.runs.c.id == run.id))
        follower.poll(_runs(engine, None), baseline=False)
        assert follower.settled() and run.id not in follower.status
    finally:
        engine.close()


def test_a_watch_whose_reader_went_away_ends_though_it_has_nothing_to_print(
    sqlite_url: str,
) -> None:
    # `agentruns watch --run RUN | head -1` on a settled run: the watch printed
    # nothing more, so it never met the broken pipe, and never ended.
    engine = _manual_engine(sqlite_url)
    try:
        run = engine.dispatch("a", trigger({}), schedule=False)
        assert engine.execute(run.id).status is RunStatus.COMPLETED
    finally:
        engine.close()
    env = {**os.environ, "AGENTRUNS_DATABASE_URL": sqlite_url, "PYTHONPATH": str(ROOT)}
    env.pop("AGENTRUNS_REDIS_URL", None)
    watcher = subprocess.Popen(
        [sys.executable, "-m", "agentruns.cli", "watch", "--run", run.id, "--interval", "0.1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert watcher.stdout is not None and watcher.stderr is not None
        assert run.id[:8] in watcher.stdout.readline()
        watcher.stdout.close()  # as `head -1` does
        assert watcher.wait(timeout=10) == 0
        assert watcher.stderr.read() == ""
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
