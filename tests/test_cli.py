"""The ``agentruns`` CLI on the embedded default (SQLite, in-process), as a newcomer uses it.

SQLite because that is what the CLI runs on without services, and executions
happen in the CLI's own process there; the Redis-down and Postgres-down cases
point at ports where nothing listens.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from pydantic import ValidationError

from agentruns import (
    Agent,
    Engine,
    LocalLeases,
    LocalScheduler,
    RedisLeases,
    RunStatus,
    SqlStore,
    Usage,
    tool,
)
from agentruns.cli import main, render
from agentruns.cli import session as session_module
from agentruns.cli.errors import database_failure
from agentruns.migrate import migrate
from agentruns.migrations import VERSION_TABLE
from agentruns.models import ScriptedModel, text, tool_use
from agentruns.models.base import ModelError
from agentruns.recovery import held_until
from agentruns.runs import utcnow
from agentruns.schedulers import ManualScheduler
from agentruns.settings import Settings
from agentruns.store.base import Commit, Guard
from tests.conftest import REDIS_URL, wait_for
from tests.support import agents as support_agents
from tests.support.proxy import Proxy
from workers import triage

ROOT = Path(__file__).resolve().parent.parent
REPORT = {"issue": "ACME-142", "title": "App crashes on start after upgrading to 2.3"}


class Cli:
    """``main(argv)`` in this process, with what it printed."""

    def __init__(self, capsys: pytest.CaptureFixture[str], url: str) -> None:
        self.capsys = capsys
        self.url = url

    def __call__(self, *argv: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        code = main(list(argv))
        out, err = self.capsys.readouterr()
        return code, out, err

    def json(self, *argv: str) -> Any:
        code, out, err = self("--json", *argv)
        assert code == 0, err
        return json.loads(out)

    def fails(self, code: int, *argv: str) -> str:
        """Run a command that must fail; return its one line of stderr."""
        got, out, err = self(*argv)
        assert got == code, (out, err)
        assert "Traceback" not in err + out
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith("agentruns: error: ")
        return lines[0]

    def waiting_run(self) -> tuple[str, str]:
        """Dispatch the triage agent; it runs here until it waits for approval."""
        result = self.json("dispatch", "triage", "--payload", json.dumps(REPORT))
        assert result["run"]["status"] == "waiting"
        return result["run"]["id"], result["approval_token"]

    def engine(self, *agents: Agent, secret: str = "test-secret") -> Engine:
        """An engine of the test's own on the CLI's database."""
        return Engine(
            SqlStore(self.url),
            leases=LocalLeases(),
            scheduler=LocalScheduler(),
            agents=list(agents) or [triage.triage],
            secret=secret,
        )


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("AGENTRUNS_DATABASE_URL", url)
    monkeypatch.setenv("AGENTRUNS_AGENTS", "workers.triage")
    monkeypatch.setenv("AGENTRUNS_SECRET", "test-secret")
    for name in ("AGENTRUNS_REDIS_URL", "AGENTRUNS_BROKER_URL", "ANTHROPIC_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(ROOT)
    return url


@pytest.fixture
def cli(env: str, capsys: pytest.CaptureFixture[str]) -> Cli:
    migrate(env)
    return Cli(capsys, env)


# -- the commands ---------------------------------------------------------------------


def test_migrate_creates_the_database_and_can_run_again(
    env: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cli = Cli(capsys, env)
    code, out, _ = cli("migrate")
    assert code == 0
    assert "migrated" in out and "revision" in out
    assert cli.json("migrate")["revision"]
    assert cli("runs")[1].strip() == "no runs"
    # Migrated by a later release that says this one works on it (a deploy rolled
    # back, whose services wait on migrate): nothing to do, not an error.
    engine = sa.create_engine(env)
    with engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {VERSION_TABLE} SET version_num = '9999'"))
    engine.dispose()
    code, out, _ = cli("migrate")
    assert code == 0 and "is at revision 9999, newer than this release knows" in out
    assert "says this release works on it: nothing to migrate" in out
    assert cli("runs")[1].strip() == "no runs"


def test_dispatch_runs_the_agent_here_until_it_waits_and_prints_the_token(cli: Cli) -> None:
    code, out, err = cli(
        "dispatch", "triage", "--payload", json.dumps(REPORT), "--key", "issue=ACME-142"
    )
    assert code == 0, err
    assert "step 0   llm" in out and "search_issues" in out
    assert "waiting on approval of post_comment" in out
    assert "agentruns approve ey" in out
    assert "agentruns approve --run" in out

    run = cli.json("runs")["runs"][0]
    assert run["status"] == "waiting"
    assert run["trigger"]["keys"] == {"issue": "ACME-142"}
    assert run["trigger"]["source"] == "cli"


def test_dispatch_with_the_same_idempotency_key_returns_the_same_run(cli: Cli) -> None:
    args = ("dispatch", "triage", "--payload", "{}", "--idempotency-key", "report-1")
    first = cli.json(*args)["run"]["id"]
    code, out, _ = cli(*args)
    assert code == 0
    assert f"already dispatched with this idempotency key: run {first}" in out
    assert len(cli.json("runs")["runs"]) == 1


def test_approve_by_token_runs_the_effect_tool_and_completes_the_run(cli: Cli) -> None:
    run_id, token = cli.waiting_run()
    # As pasted from a message, with the line's end and a stray space.
    code, out, err = cli("approve", f" {token}\n", "--reason", "reads well")
    assert code == 0, err
    assert "approved post_comment" in out
    assert "step 4   tool post_comment" in out
    assert "completed" in out

    shown = cli.json("show", run_id)["run"]
    assert shown["status"] == "completed"
    wait = next(s for s in shown["steps"] if s["kind"] == "wait")
    assert wait["output"]["approved"] is True and wait["output"]["reason"] == "reads well"
    assert [s["name"] for s in shown["steps"] if s["kind"] == "tool"].count("post_comment") == 1


def test_deny_by_run_mints_the_token_and_tells_the_model(cli: Cli) -> None:
    run_id, _ = cli.waiting_run()
    result = cli.json("deny", "--run", run_id, "--reason", "too pushy")
    assert result["run"]["status"] == "completed"
    steps = cli.json("show", run_id)["run"]["steps"]
    wait = next(s for s in steps if s["kind"] == "wait")
    assert wait["output"] == {
        "approval_id": wait["output"]["approval_id"],
        "approved": False,
        "reason": "too pushy",
    }
    # Never run: its one tool step records the denial the model got as its result.
    (posted,) = [s for s in steps if s["kind"] == "tool" and s["name"] == "post_comment"]
    assert posted["error"]["code"] == "approval_denied" and posted["output"] is None


def test_a_token_read_from_stdin_stays_out_of_the_command_line(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On the command line, a token shows in `ps` and in the shell's history.
    run_id, token = cli.waiting_run()
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{token}\n"))
    result = cli.json("deny", "-", "--reason", "no")
    assert result["run"]["id"] == run_id and result["run"]["status"] == "completed"
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert "(malformed)" in cli.fails(2, "approve", "-")


def test_runs_lists_newest_first_and_filters(cli: Cli) -> None:
    waiting, _ = cli.waiting_run()
    done, _ = cli.waiting_run()
    cli.json("approve", "--run", done)

    code, out, _ = cli("runs")
    assert code == 0
    header, *rows = out.strip().splitlines()
    assert header.split()[:3] == ["ID", "AGENT", "STATUS"]
    assert "MODEL STEPS" in header  # its count, not show's step rows
    assert rows[0].startswith(done) and rows[1].startswith(waiting)
    assert [r["id"] for r in cli.json("runs", "--status", "waiting")["runs"]] == [waiting]
    assert [r["id"] for r in cli.json("runs", "--limit", "1")["runs"]] == [done]
    assert cli.json("runs", "--agent", "nobody")["runs"] == []


def test_show_draws_the_run_as_a_timeline_with_usage(cli: Cli) -> None:
    run_id, _ = cli.waiting_run()
    cli.json("approve", "--run", run_id)
    code, out, _ = cli("show", run_id)
    assert code == 0
    assert f"run       {run_id}" in out
    assert "status    completed" in out
    assert "usage     4 model steps, 1680 in / 240 out tokens" in out
    lines = out.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("#  ")) :]
    assert [line.split()[0] for line in table[1:]] == [str(i) for i in range(8)]
    assert [line.split()[3] for line in table[1:]] == [
        "llm", "tool", "llm", "wait", "tool", "llm", "tool", "llm",
    ]  # fmt: skip
    assert all("|" in line for line in table[1:])  # the timeline bars


def test_what_a_model_or_trigger_wrote_cannot_drive_the_terminal(cli: Cli) -> None:
    # Printed as it was, ESC sequences cleared the screen and retitled the terminal,
    # and a CR overwrote the line with whatever followed it.
    @tool
    def echo(x: str) -> str:
        """Echo."""
        return "ok\x1b[31mRED\x1b[0m"

    said = "done\x1b[31m red \r overwritten\u202e"
    model = ScriptedModel(
        [
            [tool_use("evil\x1b[2J\x1b]0;pwned\x07", {}), tool_use("echo", {"x": "\x1b[5m"})],
            text(said),
        ]
    )
    with cli.engine(Agent("esc", model, tools=[echo])) as engine:
        envelope = {"source": "s\x1b[1m", "trigger": "t\x9b1m", "payload": "\x1b[41m"}
        run = engine.dispatch("esc", {**envelope, "keys": {"k": "v\x07"}}, thread="t\x1b")
        assert engine.idle(10)
    for argv in (("show", run.id), ("watch", "--run", run.id, "--until-final"), ("runs",)):
        code, out, err = cli(*argv)
        assert code == 0, err
        assert not {"\x1b", "\x07", "\r", "\x9b", "\u202e"} & set(out), (argv, out)
    _, out, _ = cli("show", run.id)
    assert "evil\\x1b[2J\\x1b]0;pwned\\x07" in out  # shown, escaped
    assert "trigger   s\\x1b[1m / t\\x9b1m  keys: k=v\\x07" in out
    assert cli.json("show", run.id)["run"]["output"] == said  # scripts get it as it is


def test_without_a_secret_a_waiting_run_is_answered_by_its_id_not_a_token(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The CLI printed a token first, signed with this process's random key: the
    # command it suggested failed with bad_signature.
    monkeypatch.delenv("AGENTRUNS_SECRET", raising=False)
    result = cli.json("dispatch", "triage", "--payload", json.dumps(REPORT))
    assert result["run"]["status"] == "waiting" and result["approval_token"] is None
    code, out, _ = cli("dispatch", "triage", "--payload", json.dumps({**REPORT, "n": 2}))
    assert code == 0 and "agentruns approve ey" not in out
    run_id = out.split()[1]
    assert f"answer:  agentruns approve --run {run_id}" in out
    assert "completed" in cli("approve", "--run", run_id)[1]


def test_cancel_cancels_a_waiting_run_and_leaves_a_final_one(cli: Cli) -> None:
    run_id, token = cli.waiting_run()
    assert cli.json("cancel", run_id)["run"]["status"] == "cancelled"
    assert "status    cancelled\n" in cli("show", run_id)[1]  # not "(cancel requested)"
    code, out, _ = cli("cancel", run_id)
    # Unchanged, and said so: "run … cancelled" alone read as if this cancel had acted.
    assert code == 0 and "it was already cancelled: a final run stays as it is" in out
    assert "stale" in cli.fails(2, "approve", token)


def test_cancel_lets_the_next_run_of_its_thread_go_on_here(cli: Cli) -> None:
    # The cancel freed the thread, and the thread's next run started in the CLI's own
    # process, which then exited under it: the run was left interrupted, 0 steps, for
    # a recover that a CLI-only deployment never runs.
    first = cli.json("dispatch", "triage", "--payload", json.dumps(REPORT), "--thread", "T1")
    assert first["run"]["status"] == "waiting"
    queued = cli.json("dispatch", "triage", "--payload", json.dumps(REPORT), "--thread", "T1")
    assert queued["run"]["status"] == "queued"  # behind the first, which holds the thread
    code, out, _ = cli("cancel", first["run"]["id"])
    assert code == 0 and f"run {first['run']['id']} cancelled" in out
    nxt = queued["run"]["id"]
    assert f"run {nxt} running" in out and f"run {nxt} waiting on approval" in out
    assert cli.json("show", nxt)["run"]["status"] == "waiting"


def test_cancel_of_a_run_another_process_holds_says_it_may_have_died(cli: Cli) -> None:
    # Its process killed: "stops within about a second" (local leases cannot tell),
    # though it settles only once its claim expires and recover takes it.
    engine = cli.engine()
    run = engine.dispatch(
        "triage", {"source": "t", "trigger": "t", "payload": REPORT}, schedule=False
    )
    assert engine.store.claim(run.id, "elsewhere:1", utcnow() + timedelta(seconds=30))
    engine.close()
    code, out, _ = cli("cancel", run.id)
    assert code == 0 and "stops within about a second" in out
    assert "if the process running it died, it settles cancelled when `agentruns recover`" in out


def test_show_and_cancel_say_when_no_worker_holds_a_running_run(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A run whose worker died looked healthy: `show` printed its claim "until" a time
    # already past, and `cancel` said its execution stops within about a second.
    monkeypatch.setenv("AGENTRUNS_REDIS_URL", REDIS_URL)
    monkeypatch.setenv("AGENTRUNS_SECRET", "test-secret")
    agent = triage.make_agent(triage.scripted_model())
    engine = Engine(SqlStore(cli.url), scheduler=ManualScheduler(), agents=[agent], secret="s")
    trigger = {"source": "t", "trigger": "t", "payload": REPORT}
    run = engine.dispatch("triage", trigger, schedule=False)
    assert engine.store.claim(run.id, "dead:1", utcnow() - timedelta(seconds=1)) is not None
    code, out, _ = cli("show", run.id)
    assert code == 0 and "(expired: `agentruns recover` requeues it)" in out
    assert "losses" not in out
    # Lost again at the same step: held back, and the count is shown.
    assert engine.recover() == [run.id]
    lost = engine.store.claim(run.id, "dead:2", utcnow() - timedelta(seconds=1))
    assert lost is not None and lost.run.claim is not None
    monkeypatch.setenv("AGENTRUNS_REQUEUE_AFTER", "600")
    code, out, _ = cli("show", run.id)
    # When the hold ends, as recover reckons it (5-15 min past the claim's expiry).
    ends = held_until(run.id, lost.run.claim.expires_at, 1, 600.0)
    assert timedelta(minutes=4) < ends - utcnow() < timedelta(minutes=15)
    other_day = ends.astimezone().date() != utcnow().astimezone().date()
    assert f"requeues it once its hold ends, at {render.clock(ends, date=other_day)})" in out
    assert "losses    1 in a row at its step, each with its worker" in out
    # Let go by a live worker (an outage): recover requeues it at once, and so says show.
    leases = RedisLeases(REDIS_URL)
    leases.give_up(run.id, lost.epoch, 60)
    leases.close()
    code, out, _ = cli("show", run.id)
    assert "(expired: `agentruns recover` requeues it)" in out
    engine.close()
    code, out, _ = cli("cancel", run.id)
    assert code == 0 and "no worker holds it now" in out


def test_cancel_does_not_take_a_run_its_owner_stopped_meanwhile_for_an_orphan(cli: Cli) -> None:
    # Its owner stopped the run and let its lease go between the cancel and the look
    # at the lease: `cancel` said "no worker holds it now (its worker died ...)".
    from agentruns.cli.commands import _unheld

    leases = RedisLeases(REDIS_URL, prefix=f"t{uuid.uuid4().hex[:8]}")
    engine = Engine(
        SqlStore(cli.url),
        leases=leases,
        scheduler=ManualScheduler(),
        agents=[triage.make_agent(triage.scripted_model())],
        secret="s",
    )
    run = engine.dispatch("triage", {"source": "t", "trigger": "t", "payload": REPORT})
    claimed = engine.store.claim(run.id, "owner:1", utcnow() + timedelta(seconds=30))
    assert claimed is not None
    assert engine.cancel(run.id).status is RunStatus.RUNNING
    assert _unheld(engine, run.id) is True  # running, and no lease: an orphan
    stopped = Commit(status=RunStatus.CANCELLED, release_claim=True)
    engine.store.commit(claimed.run, Guard(status=RunStatus.RUNNING, epoch=claimed.epoch), stopped)
    assert _unheld(engine, run.id) is False
    engine.close()


def test_recover_continues_an_interrupted_run(cli: Cli) -> None:
    slow = triage.make_agent(triage.scripted_model(latency_s=30))
    engine = cli.engine(slow)
    run = engine.dispatch("triage", {"source": "t", "trigger": "t", "payload": REPORT})
    deadline = time.monotonic() + 10
    while engine.get_run(run.id).status is not RunStatus.RUNNING:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    engine.close()  # drains: the run is interrupted mid model call
    assert engine.get_run(run.id).status is RunStatus.INTERRUPTED

    code, out, err = cli("recover")
    assert code == 0, err
    assert "requeued 1 run(s)" in out
    assert f"run {run.id} waiting on approval of post_comment" in out
    assert cli.json("recover") == {"requeued": [], "runs": []}


def _interruptible(*argv: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """``agentruns *argv`` in a process of its own that takes Ctrl-C as a terminal gives
    it: a test run started in the background of a script inherits SIGINT ignored, and
    Python would leave it so."""
    return subprocess.Popen(
        [sys.executable, "-m", "agentruns.cli", *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _hanging_dispatch(agent: str, hang: str, tmp_path: Path) -> subprocess.Popen[str]:
    """``agentruns dispatch AGENT`` (embedded), once its ``hang`` (the ``note`` tool, the
    ``notifier``: see tests.support.agents) hangs, which it does until the process ends."""
    log = tmp_path / "tools.log"
    env = {
        **os.environ,
        "AGENTRUNS_AGENTS": "tests.support.agents",
        "AGENTRUNS_TEST_HANG": hang,
        "AGENTRUNS_TEST_LOG": str(log),
    }
    dispatch = _interruptible("dispatch", agent, "--payload", "{}", env=env)
    try:
        wait_for(lambda: log.exists() and f"hanging {hang}" in log.read_text(), f"{hang} to hang")
    except BaseException:
        dispatch.kill()
        raise
    return dispatch


def test_a_second_ctrl_c_cuts_the_drain_short_without_a_traceback(cli: Cli, tmp_path: Path) -> None:
    # The first Ctrl-C drains, which waits for the tool call in flight: here one that
    # hangs, so only a second Ctrl-C gets the person their prompt back.
    dispatch = _hanging_dispatch("steps", "note", tmp_path)
    try:
        dispatch.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert dispatch.poll() is None  # draining: waiting for the tool
        dispatch.send_signal(signal.SIGINT)
        _, err = dispatch.communicate(timeout=20)
    finally:
        dispatch.kill()
    assert dispatch.returncode == 130, err
    assert err.strip() == "agentruns: interrupted", err


def test_ctrl_c_does_not_wait_for_a_notifier_that_hangs(cli: Cli, tmp_path: Path) -> None:
    # The run is waiting and its notifier hangs (a webhook with no timeout): the
    # command waits for it, and a Ctrl-C then waited for it another 10 s at close.
    dispatch = _hanging_dispatch("hung_pager", "notifier", tmp_path)
    try:
        dispatch.send_signal(signal.SIGINT)
        _, err = dispatch.communicate(timeout=session_module.NOTIFIERS_WAIT_S / 2)
    finally:
        dispatch.kill()
    assert dispatch.returncode == 130, err
    assert err.strip() == "agentruns: interrupted", err


def test_the_cli_module_imports_nothing_heavy() -> None:
    # What the console script imports before main() runs: a Ctrl-C there is Python's
    # traceback, so SQLAlchemy, Celery, pydantic and redis wait for main().
    code = (
        "import sys, agentruns.cli; "
        "print([m for m in ('sqlalchemy', 'celery', 'pydantic', 'redis', 'anthropic') "
        "if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_ctrl_c_while_the_cli_starts_is_one_line() -> None:
    # Ctrl-C as the command's modules load (here: as SQLAlchemy's is imported, as a
    # person's SIGINT would land there) says one line and exits 130, no traceback.
    code = """
import sys

class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == "sqlalchemy":
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, CtrlC())
from agentruns.cli import main
sys.exit(main(["runs"]))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 130, done.stderr
    assert done.stderr == "agentruns: interrupted\n"


def test_an_embedded_dispatch_whose_writes_lose_the_database_fails_in_one_line(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = Proxy(("127.0.0.1", 5432))
    via_proxy = db_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    monkeypatch.setenv("AGENTRUNS_DATABASE_URL", via_proxy)
    monkeypatch.setenv("AGENTRUNS_AGENTS", "tests.support.agents")
    monkeypatch.delenv("AGENTRUNS_REDIS_URL", raising=False)

    def cut_the_writes() -> None:  # once the run is under way, a write breaks off
        with psycopg.connect(db_url.replace("+psycopg", "", 1), autocommit=True) as conn:
            while not conn.execute("SELECT count(*) FROM agentruns_steps").fetchone()[0]:
                time.sleep(0.02)
        proxy.hold()  # the server goes silent: the next step's write waits (0.3 s apart)
        time.sleep(0.6)
        proxy.cut()  # and then its connection is gone
        proxy.restore()

    cutter = threading.Thread(target=cut_the_writes)
    cutter.start()
    try:
        code, _, err = Cli(capsys, via_proxy)("dispatch", "steps", "--payload", "{}")
    finally:
        cutter.join()
        proxy.close()
    # The database is back for the CLI's last read: only the execution's report tells.
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"agentruns: error: database error on {via_proxy}: server closed")


def test_tick_says_when_a_notifier_fails(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    # The notifier's failure is not the command's: the run waits, and tick retries.
    monkeypatch.setenv("AGENTRUNS_AGENTS", "tests.support.agents")
    code, out, err = cli("--json", "dispatch", "pager", "--payload", "{}")
    run = json.loads(out)["run"]
    assert code == 0 and run["status"] == "waiting"
    failed = f"the notifier of run {run['id']} failed: ConnectionRefusedError: the pager is down"
    # The dispatch said nothing of it: the person it was to page never heard.
    assert err == f"agentruns: WARNING: {failed} (`agentruns tick` calls it again)\n"
    result = cli.json("tick")
    assert result["errors"] == [failed] and result["notified"] == []
    code, out, _ = cli("tick")
    assert code == 0
    assert f"1 failed, the next tick tries again: {failed}" in out


def test_a_notifier_that_hangs_does_not_hang_the_command(
    cli: Cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A webhook without a timeout held `agentruns dispatch` (embedded) and `tick` for
    # ever: from cron, the ticks piled up. Its call is left under way, the run not
    # marked notified, and the command ends after NOTIFIERS_WAIT_S, saying so.
    monkeypatch.setattr(session_module, "NOTIFIERS_WAIT_S", 0.5)
    monkeypatch.setenv("AGENTRUNS_AGENTS", "tests.support.agents")
    monkeypatch.setenv("AGENTRUNS_TEST_HANG", "notifier")
    monkeypatch.setenv("AGENTRUNS_TEST_LOG", str(tmp_path / "log"))
    left = "agentruns: WARNING: a notifier call has not returned after 0.5s: left under way"
    try:
        code, out, err = cli("--json", "dispatch", "hung_pager", "--payload", "{}")
        assert code == 0, err
        run = json.loads(out)["run"]
        assert run["status"] == "waiting"
        assert err.startswith(left) and len(err.splitlines()) == 1, err
        code, out, err = cli("--json", "tick")
        assert code == 0, err
        assert json.loads(out)["notified"] == []
        assert err.startswith(left) and len(err.splitlines()) == 1, err
        calls = (tmp_path / "log").read_text().splitlines()
        assert calls == [f"hanging notifier of {run['id']}"] * 2
    finally:
        support_agents.notifier_released.set()


def test_tick_denies_an_expired_approval_and_the_run_goes_on(cli: Cli) -> None:
    hasty = Agent(
        "triage",
        triage.scripted_model(),
        tools=[triage.search_issues, triage.label_issue, triage.post_comment],
        approval_ttl=timedelta(seconds=0.5),
    )
    engine = cli.engine(hasty)
    run = engine.dispatch("triage", {"source": "t", "trigger": "t", "payload": REPORT})
    assert engine.idle(10)
    time.sleep(1.1)
    token = engine.approval_token(run.id)
    engine.close()

    assert "expired" in cli.fails(2, "approve", token)
    result = cli.json("tick")
    assert result == {"expired": [run.id], "notified": [], "waiting": 0, "errors": []}
    steps = cli.json("show", run.id)["run"]["steps"]
    wait = next(s for s in steps if s["kind"] == "wait")
    assert wait["output"]["reason"] == "approval expired"
    assert cli("tick")[1].startswith("tick: 0 expired approval(s) denied")


def test_watch_prints_a_runs_history_and_stops_when_it_settles(cli: Cli) -> None:
    run_id, _ = cli.waiting_run()
    cli.json("approve", "--run", run_id)
    code, out, _ = cli("watch", "--run", run_id, "--until-final", "--interval", "0.05")
    assert code == 0
    assert out.count(" step ") == 8
    lines = out.strip().splitlines()
    assert lines[-2].split(maxsplit=1)[1].startswith(f"run {run_id} completed")
    assert lines[-1] == f"watching run {run_id} every 0.05s until it settles"  # no Redis

    code, out, _ = cli("--json", "watch", "--run", run_id, "--until-final")
    events = [json.loads(line) for line in out.splitlines()]
    assert [e["event"] for e in events] == ["step.appended"] * 8 + ["run.updated"]


def test_watch_follows_runs_another_process_writes(cli: Cli, env: str) -> None:
    watcher = _interruptible("watch", "--interval", "0.1", env=os.environ.copy())
    try:
        assert watcher.stdout is not None
        assert watcher.stdout.readline().startswith("watching all runs")
        run_id, _ = cli.waiting_run()
        seen: list[str] = []
        deadline = time.monotonic() + 20
        while not any("waiting on approval" in line for line in seen):
            assert time.monotonic() < deadline, seen
            seen.append(watcher.stdout.readline())
        assert any(f"{run_id[:8]} step 2   llm" in line for line in seen)
    finally:
        watcher.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            _, err = watcher.communicate(timeout=10)
        finally:
            watcher.kill()  # not left behind if it did not stop
    assert watcher.returncode == 0 and "Traceback" not in err


def test_json_output_is_json_for_every_command(cli: Cli) -> None:
    run_id, token = cli.waiting_run()
    assert cli.json("show", run_id)["run"]["waiting"]["tool_name"] == "post_comment"
    assert cli.json("approve", token)["run"]["status"] == "completed"
    assert cli.json("cancel", run_id)["run"]["status"] == "completed"
    assert set(cli.json("tick")) == {"expired", "notified", "waiting", "errors"}
    assert cli.json("runs")["runs"][0]["id"] == run_id


# -- bad input: one line, the right exit code, nothing changed ------------------------------


def test_an_unknown_run_is_one_line_and_exit_2(cli: Cli) -> None:
    expected = "agentruns: error: no run with id 'nope' (see `agentruns runs`)"
    for argv in (["show", "nope"], ["cancel", "nope"], ["approve", "--run", "nope"]):
        assert cli.fails(2, *argv) == expected
    assert "no run" in cli.fails(2, "watch", "--run", "nope")


def test_bad_tokens_say_why_and_change_nothing(cli: Cli) -> None:
    run_id, token = cli.waiting_run()
    assert "(malformed)" in cli.fails(2, "approve", "not-a-token")
    assert "(malformed)" in cli.fails(2, "deny", "abc.def")
    body, signature = token.split(".")
    forged = f"{body}.{'A' if signature[0] != 'A' else 'B'}{signature[1:]}"
    assert "(bad_signature)" in cli.fails(2, "approve", forged)
    other = cli.engine(secret="another-secret")
    assert "(bad_signature)" in cli.fails(2, "approve", other.approval_token(run_id))
    other.close()
    assert cli.json("show", run_id)["run"]["status"] == "waiting"

    cli.json("approve", token)
    assert "(stale)" in cli.fails(2, "approve", token)
    assert "is completed, not waiting" in cli.fails(2, "approve", "--run", run_id)


def test_approve_by_run_pinned_to_an_approval_refuses_another(cli: Cli) -> None:
    # An operator answering by the run's id answered whatever it waited on by then,
    # which may be an approval another operator's answer led to, not the one shown.
    run_id, _ = cli.waiting_run()
    approval = cli.json("show", run_id)["run"]["waiting"]["approval_id"]
    shown = cli("show", run_id)[1]
    assert f"answer: agentruns approve --run {run_id} --approval {approval}  (or deny)" in shown
    said = cli.fails(2, "approve", "--run", run_id, "--approval", "0" * 32)
    assert f"(stale): run {run_id} waits on approval {approval} now" in said
    assert cli.json("show", run_id)["run"]["status"] == "waiting"
    assert "--approval goes with --run" in cli.fails(2, "deny", "x.y", "--approval", approval)
    assert "--approval goes with --run" in cli.fails(2, "deny", "--approval", approval)
    assert "completed" in cli("approve", "--run", run_id, "--approval", approval)[1]


def test_approve_needs_exactly_one_of_token_and_run(cli: Cli) -> None:
    assert "give either a TOKEN or --run RUN" in cli.fails(2, "approve")
    assert "give either a TOKEN or --run RUN" in cli.fails(2, "deny", "tok", "--run", "r")


def test_a_payload_that_is_not_json_stores_nothing(cli: Cli) -> None:
    line = cli.fails(2, "dispatch", "triage", "--payload", "{not json")
    assert line.startswith("agentruns: error: --payload is not JSON")
    assert "name=value" in cli.fails(2, "dispatch", "triage", "--key", "no-equals")
    twice = ("--key", "issue=1", "--key", "issue=2")  # the last was kept, unsaid
    assert "--key issue is given twice: '1' and '2'" in cli.fails(2, "dispatch", "triage", *twice)
    assert cli.json("runs")["runs"] == []


def test_an_unknown_agent_stores_nothing(cli: Cli) -> None:
    line = cli.fails(2, "dispatch", "nobody", "--payload", "{}")
    assert line == (
        "agentruns: error: unknown agent 'nobody' (known: triage; AGENTRUNS_AGENTS=workers.triage)"
    )
    assert cli.json("runs")["runs"] == []


def test_usage_errors_are_one_line_and_exit_2(cli: Cli) -> None:
    assert "invalid choice" in cli.fails(2, "frobnicate")
    assert "invalid choice" in cli.fails(2, "runs", "--status", "sleeping")
    assert "required" in cli.fails(2, "show")
    for limit in ("0", "-1", "99999999999999999999"):
        assert "--limit: must be from 1 to" in cli.fails(2, "runs", "--limit", limit)
    # Not "invalid _limit value": no name of the code's own.
    assert "--limit: must be a whole number, not 'abc'" in cli.fails(2, "runs", "--limit", "abc")
    # 1e300 ended in "unexpected OverflowError: timestamp out of range"; 1e-300 read
    # the database in a busy loop.
    for interval in ("nan", "inf", "0", "soon", "1e300", "1e-300", "0.01", "86401"):
        said = cli.fails(2, "watch", "--interval", interval)
        assert f"--interval: must be from 0.05 to 86400 seconds, not {interval!r}" in said


def test_text_that_is_not_utf8_is_refused_and_stores_nothing(cli: Cli) -> None:
    undecodable = b"\xff\xfe".decode("utf-8", "surrogateescape")  # as argv holds such bytes
    for argv in (
        ["show", undecodable],
        ["cancel", undecodable],
        ["runs", "--agent", undecodable],
        ["dispatch", "triage", "--thread", undecodable],
        ["dispatch", "triage", "--key", f"k={undecodable}"],
    ):
        assert "is not valid UTF-8" in cli.fails(2, *argv)
    # Valid JSON whose text no store can keep: a lone surrogate escape.
    assert "surrogates not allowed" in cli.fails(2, "dispatch", "triage", "--payload", '"\\ud800"')
    deep = "[" * 500 + "]" * 500
    assert "payload is not JSON" in cli.fails(2, "dispatch", "triage", "--payload", deep)
    deeper = "[" * 100_000 + "]" * 100_000
    assert "--payload is not JSON" in cli.fails(2, "dispatch", "triage", "--payload", deeper)
    assert cli.json("runs")["runs"] == []


def test_agent_modules_that_do_not_import_are_one_line(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTRUNS_AGENTS", "workers.nonexistent")
    assert "AGENTRUNS_AGENTS" in cli.fails(1, "dispatch", "triage")
    assert cli("runs")[0] == 0  # reading runs does not need the agents' code


def test_a_database_file_that_is_not_there_says_to_migrate(
    env: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = Cli(capsys, env).fails(1, "runs")
    assert "does not exist: run `agentruns migrate`" in line
    assert not Path(env.removeprefix("sqlite:///")).exists()


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "sqlite:///"])
def test_an_in_memory_sqlite_database_is_refused_for_a_file(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, env: str, url: str
) -> None:
    # `migrate` said "migrated" and exited 0, and every other command then said the
    # database was not migrated: run migrate, which had just been run.
    monkeypatch.setenv("AGENTRUNS_DATABASE_URL", url)
    cli = Cli(capsys, env)
    for argv in (["migrate"], ["runs"]):
        line = cli.fails(1, *argv)
        assert f"{url} is an in-memory database, gone when this command ends" in line


def test_a_sqlite_file_that_cannot_be_opened_says_why(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, env: str, tmp_path: Path
) -> None:
    # Each said "a new database needs `agentruns migrate`" to `agentruns migrate`.
    cli = Cli(capsys, env)
    for url, said in (
        (
            f"sqlite:///{tmp_path}/nowhere/runs.db",
            f"the directory {tmp_path}/nowhere does not exist",
        ),
        (f"sqlite:///{tmp_path}", f"{tmp_path} is a directory: name a file in it"),
        (
            f"sqlite+aiosqlite:///{tmp_path}/a.db",
            "or SQLite (sqlite:///...), not sqlite+aiosqlite://",
        ),
    ):
        monkeypatch.setenv("AGENTRUNS_DATABASE_URL", url)
        line = cli.fails(2 if "aiosqlite" in url else 1, "migrate")  # a setting it refuses
        assert said in line and "needs `agentruns migrate`" not in line, line


def test_a_failed_commit_on_sqlite_is_said_as_its_error_not_as_a_file_not_opened() -> None:
    # A full disk failed the COMMIT, which SQLAlchemy reports with no statement, as it
    # does a connection that could not be made: "cannot open the database … (check
    # AGENTRUNS_DATABASE_URL; a new database needs agentruns migrate)".
    full = sa.exc.OperationalError(None, None, sqlite3.OperationalError("database or disk is full"))
    said = database_failure("sqlite:////data/runs.db", full)
    assert said == "database error on sqlite:////data/runs.db: database or disk is full"


def test_a_database_that_is_not_migrated_says_to_migrate(
    env: str, capsys: pytest.CaptureFixture[str]
) -> None:
    Path(env.removeprefix("sqlite:///")).touch()
    for argv in (["runs"], ["show", "x"], ["dispatch", "triage", "--payload", "{}"]):
        line = Cli(capsys, env).fails(1, *argv)
        assert "is not migrated" in line and "run `agentruns migrate`" in line


def test_a_database_that_cannot_be_reached_is_one_line(
    env: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTRUNS_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:1/x")
    cli = Cli(capsys, env)
    for argv in (["runs"], ["migrate"], ["approve", "--run", "r"]):
        line = cli.fails(1, *argv)
        assert "cannot open the database postgresql+psycopg://postgres@127.0.0.1:1/x" in line
        assert "Connection refused" in line
    # A server without the database: migrate makes tables, not databases (it said to
    # run migrate, to migrate).
    monkeypatch.setenv(
        "AGENTRUNS_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/agentruns_nowhere"
    )
    line = cli.fails(1, "migrate")
    assert 'database "agentruns_nowhere" does not exist' in line
    assert "create it (`createdb`, or your provider's console), then `agentruns migrate`" in line


def test_a_url_that_is_not_one_names_its_setting_and_hides_its_password(
    env: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each was "unexpected ValueError: ..." naming no setting; a Redis URL whose path
    # is not a number was taken as database 0 here and refused by Celery's transport
    # (a dispatch stored its run, said "queued for a worker" and exited 0).
    cli = Cli(capsys, env)
    cases = [
        ("DATABASE_URL", "postgresql+psycopg://u:hunter2@127.0.0.1:notaport/x", "not a database"),
        ("REDIS_URL", "redis://:hunter2@127.0.0.1:abc/10", "not a Redis URL"),
        ("REDIS_URL", "http://127.0.0.1:6379/10", "not a Redis URL"),
        ("REDIS_URL", "redis://127.0.0.1:6379/abc", "is its database number, not 'abc'"),
        ("BROKER_URL", "redis://:hunter2@127.0.0.1:6379/x1", "is its database number"),
        # Exit 1, "agentruns stores runs in Postgres ...", naming no setting.
        ("DATABASE_URL", "bogus://u:hunter2@x/y", "or SQLite (sqlite:///...), not bogus://"),
        ("DATABASE_URL", "postgresql+psycopg2://x/y", "not postgresql+psycopg2://"),
    ]
    for name, url, said in cases:
        with monkeypatch.context() as scoped:
            scoped.setenv(f"AGENTRUNS_{name}", url)
            for argv in (["runs"], ["dispatch", "triage", "--payload", "{}"]):
                line = cli.fails(2, *argv)
                assert f"invalid setting AGENTRUNS_{name}: " in line and said in line, line
                assert "hunter2" not in line and "Value error" not in line
    # A password with a '/' not percent-encoded: the parser quoted a piece of it.
    for name, url in (
        ("REDIS_URL", "redis://:Zm9v/YmFy@127.0.0.1:6379/1"),
        ("DATABASE_URL", "postgresql+psycopg://u:p@ss:word@127.0.0.1/x"),
    ):
        with monkeypatch.context() as scoped:
            scoped.setenv(f"AGENTRUNS_{name}", url)
            line = cli.fails(2, "runs")
            assert "percent-encode" in line and "Zm9v" not in line and "ss:word" not in line, line
    monkeypatch.setenv("AGENTRUNS_BROKER_URL", "amqp://guest:guest@127.0.0.1:1//")
    Settings()  # another broker's URL is Celery's to judge
    failover = "redis://127.0.0.1:6379/12;redis://127.0.0.1:6380/12"  # kombu's alternates
    monkeypatch.setenv("AGENTRUNS_BROKER_URL", failover)
    assert Settings().broker_url == failover
    monkeypatch.setenv("AGENTRUNS_BROKER_URL", "redis://127.0.0.1:6379/12;redis://h/x")
    with pytest.raises(ValidationError, match="database number, not 'x'"):
        Settings()


def test_a_database_that_opens_but_fails_is_not_sent_to_migrate(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The database is there and migrated, but its statements fail (here: they wait on
    # a lock past statement_timeout; a full disk does the same): "check the URL, run
    # migrate" would send the person round in a circle.
    url = f"{db_url}?options=-c%20statement_timeout%3D300"
    monkeypatch.setenv("AGENTRUNS_DATABASE_URL", url)
    with psycopg.connect(db_url.replace("+psycopg", "", 1)) as holder:
        holder.execute("LOCK TABLE agentruns_runs IN ACCESS EXCLUSIVE MODE")
        line = Cli(capsys, url).fails(1, "runs")
    assert line.startswith("agentruns: error: database error on ")
    assert line.endswith(": canceling statement due to statement timeout")


def test_two_agent_modules_with_one_agent_name_are_refused_in_one_line(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module in ("twins_a", "twins_b"):
        (tmp_path / f"{module}.py").write_text(
            "from agentruns import Agent\n"
            "from agentruns.models import ScriptedModel, text\n"
            "twin = Agent('twin', ScriptedModel([text('ok')]))\n"
        )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("AGENTRUNS_AGENTS", "twins_a,twins_b")
    line = cli.fails(1, "dispatch", "twin", "--payload", "{}")
    assert line.startswith("agentruns: error: two agents are named 'twin', in twins_a and twins_b")
    assert cli.json("runs")["runs"] == []


def test_redis_down_is_one_line_and_stores_nothing(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTRUNS_REDIS_URL", "redis://127.0.0.1:1/0")
    line = cli.fails(1, "dispatch", "triage", "--payload", "{}")
    assert line.startswith("agentruns: error: cannot reach Redis at redis://127.0.0.1:1/0")
    for argv in (["recover"], ["tick"], ["cancel", "x"], ["approve", "x.y"]):
        assert "cannot reach Redis" in cli.fails(1, *argv)
    assert cli.json("runs")["runs"] == []  # reads do not need Redis


# -- through a real process -----------------------------------------------------------


def _agentruns(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "agentruns"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "agentruns.cli"]
    return subprocess.run(
        [*command, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_the_console_script_dispatches_approves_and_shows(env: str) -> None:
    environ = os.environ.copy()
    assert _agentruns("migrate", env=environ).returncode == 0
    done = _agentruns("--json", "dispatch", "triage", "--payload", json.dumps(REPORT), env=environ)
    assert done.returncode == 0, done.stderr
    token = json.loads(done.stdout)["approval_token"]
    approved = _agentruns("approve", token, env=environ)
    assert approved.returncode == 0, approved.stderr
    assert "completed" in approved.stdout
    run_id = json.loads(done.stdout)["run"]["id"]
    shown = _agentruns("show", run_id, env=environ)
    assert "status    completed" in shown.stdout and shown.stderr == ""


@pytest.mark.parametrize(
    ("argv", "setting", "code", "says"),
    [
        (["show", "nope"], None, 2, "no run with id 'nope'"),
        (["approve", "garbage"], None, 2, "invalid resume token (malformed)"),
        (["dispatch", "triage", "--payload", "{"], None, 2, "--payload is not JSON"),
        (["dispatch", "nobody"], None, 2, "unknown agent 'nobody'"),
        (["runs"], "postgresql+psycopg://postgres@127.0.0.1:1/x", 1, "cannot open the database"),
        (["runs"], "missing", 1, "run `agentruns migrate`"),
    ],
)
def test_errors_from_a_real_process_have_no_traceback(
    env: str, argv: list[str], setting: str | None, code: int, says: str, tmp_path: Path
) -> None:
    environ = os.environ.copy()
    if setting == "missing":
        environ["AGENTRUNS_DATABASE_URL"] = f"sqlite:///{tmp_path / 'missing.db'}"
    elif setting is not None:
        environ["AGENTRUNS_DATABASE_URL"] = setting
    else:
        migrate(env)
    result = _agentruns(*argv, env=environ)
    assert result.returncode == code
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert says in result.stderr


def test_watch_prints_a_start_before_the_steps_of_that_execution(cli: Cli) -> None:
    from agentruns.cli.session import Session
    from agentruns.cli.watch import _Follower

    engine = cli.engine()
    out = io.StringIO()
    follower = _Follower(Session(as_json=True, out=out), engine, history=True)

    def lines() -> list[tuple[str, Any]]:
        found = [json.loads(line) for line in out.getvalue().splitlines()]
        out.truncate(0)
        out.seek(0)
        return [
            ("run", e["run"]["status"])
            if e["event"] == "run.updated"
            else ("step", e["step"]["index"])
            for e in found
        ]

    # Seen running, with its first step: the start comes first.
    first = engine.dispatch(
        "triage", {"source": "t", "trigger": "t", "payload": REPORT}, schedule=False
    )
    follower.poll([engine.get_run(first.id)], baseline=True)
    stop = engine.on("step.appended", lambda e: follower.poll([engine.get_run(first.id)], False))
    engine.execute(first.id)
    stop()
    follower.poll([engine.get_run(first.id)], baseline=False)
    got = lines()
    assert got[:3] == [("run", "queued"), ("run", "running"), ("step", 0)]
    assert got[-1] == ("run", "waiting")
    assert [i for kind, i in got if kind == "step"] == list(range(len(engine.steps(first.id))))

    # Started and settled between two looks: the event that said it started is printed
    # as the start, before the steps, and the settled status after them.
    second = engine.dispatch(
        "triage", {"source": "t", "trigger": "u", "payload": REPORT}, schedule=False
    )
    follower.poll([engine.get_run(second.id)], baseline=False)
    follower.heard({"type": "run.updated", "run_id": second.id, "status": "running"})
    engine.execute(second.id)
    follower.poll([engine.get_run(second.id)], baseline=False)
    steps = len(engine.steps(second.id))
    assert lines() == [("run", "queued"), ("run", "running")] + [
        ("step", i) for i in range(steps)
    ] + [("run", "waiting")]
    engine.close()


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://app:PWMARK@db.example/agentruns",
        "postgresql+psycopg://app@db.example/agentruns?password=PWMARK&sslmode=require",
        "postgresql+psycopg://app@db.example/agentruns?sslpassword=PWMARK",
        "redis://redis.example:6379/0?password=PWMARK",
    ],
)
def test_a_url_is_shown_without_its_passwords(url: str) -> None:
    # A password given as a query parameter (libpq and redis-py take one) was shown
    # in the CLI's errors and migrate's output, and in the store's schema errors.
    from agentruns.store.connect import shown_url

    shown = shown_url(url)
    assert "PWMARK" not in shown and "example" in shown
    assert "sslmode=require" in shown or "sslmode" not in url


def test_the_example_notifier_logs_no_resume_token(caplog: pytest.LogCaptureFixture) -> None:
    # The token is a credential: the example agent (the default AGENTRUNS_AGENTS)
    # logged it whole at INFO, in every worker's log.
    from types import SimpleNamespace

    from agentruns.runs import WaitPoint, utcnow

    run: Any = SimpleNamespace(id="run-1")  # what the notifier reads of its run
    wait = WaitPoint(
        approval_id="a",
        tool_name="post_comment",
        input={"issue": "1"},
        expires_at=utcnow(),
        token_id="t",
        tool_call_id="c",
    )
    with caplog.at_level("INFO"):
        triage.notify(run, wait, "v1.TOKENMARK.SIGNATURE")
    assert "TOKENMARK" not in caplog.text and "approve --run run-1" in caplog.text


def test_retry_goes_on_with_a_failed_run_and_refuses_any_other(cli: Cli) -> None:
    class Overloaded(ScriptedModel):
        def complete(self, request: Any, signal: threading.Event) -> Any:
            raise ModelError("overloaded_error: Overloaded (529), 4 retries")

    engine = cli.engine(triage.make_agent(Overloaded([text("x")])))
    run = engine.dispatch("triage", {"source": "t", "trigger": "t", "payload": REPORT})
    assert engine.idle(10)
    assert engine.get_run(run.id).status is RunStatus.FAILED
    engine.close()
    code, out, _ = cli("show", run.id)
    assert f"retry: agentruns retry {run.id}  (from its latest checkpoint)" in out
    # The provider is back: the workers' agent (the scripted triage) takes the run on.
    code, out, _ = cli("retry", run.id)
    assert code == 0
    assert f"retrying run {run.id} (triage) from its latest checkpoint" in out
    assert "waiting" in out and f"agentruns approve --run {run.id}" in out
    said = cli.fails(2, "retry", run.id)
    assert said.endswith(f"run {run.id} is waiting: only a failed (or queued) run is retried")
    assert "no run with id" in cli.fails(2, "retry", "no-such-run")


def test_dispatch_and_retry_take_a_budget(cli: Cli) -> None:
    code, out, _ = cli(
        "--json",
        "dispatch",
        "triage",
        "--payload",
        json.dumps(REPORT),
        "--budget",
        '{"max_steps": 1}',
    )
    run = json.loads(out)["run"]
    assert code == 0 and run["status"] == "failed"  # one step of the scripted triage's two
    assert run["error"]["code"] == "step_budget_exceeded"
    assert run["budget"] == {"max_steps": 1, "max_tokens": 200_000, "timeout_s": 300.0}
    for bad, said in (
        ("[1]", "--budget takes a JSON object of limits, not [1]"),
        ("{", "--budget is not JSON: "),
        ('{"max_steps": 0}', "invalid budget: "),
    ):
        assert said in cli.fails(2, "retry", run["id"], "--budget", bad)
    code, out, _ = cli("show", run["id"])
    # Room for more than one step: 2, one more, failed the scripted triage again
    # after the approval its second step asks.
    assert f"""retry: agentruns retry {run["id"]} --budget '{{"max_steps": 11}}'""" in out
    # A retry's budget below what the run used: the hint is from the use, not the limit.
    cli("retry", run["id"], "--budget", '{"max_steps": 5, "max_tokens": 10}')
    code, out, _ = cli("show", run["id"])
    assert "token_budget_exceeded: the run used 480 of 10 tokens" in out
    assert f"""retry: agentruns retry {run["id"]} --budget '{{"max_tokens": 10480}}'""" in out
    code, out, _ = cli(
        "--json", "retry", run["id"], "--budget", '{"max_steps": 5, "max_tokens": 200000}'
    )
    retried = json.loads(out)["run"]
    assert code == 0 and retried["status"] == "waiting"  # on to the approval its second step asks
    assert retried["budget"] == {"max_steps": 5, "max_tokens": 200_000, "timeout_s": 300.0}


def test_show_of_a_failed_run_its_thread_went_on_without_does_not_suggest_retry(
    cli: Cli,
) -> None:
    # It suggested `agentruns retry RUN`, which then refused the run.
    class FailsSecond(ScriptedModel):
        def complete(self, request: Any, signal: threading.Event) -> Any:
            if "second" in str(request.messages[-1]):
                raise ModelError("overloaded_error: Overloaded (529), 4 retries")
            return super().complete(request, signal)

    engine = Engine(
        SqlStore(cli.url),
        scheduler=ManualScheduler(),
        agents=[Agent("a", FailsSecond([text("ok")]))],
        secret="s",
    )
    runs = [
        engine.dispatch(
            "a", {"source": "t", "trigger": "t", "payload": w}, thread="T", schedule=False
        )
        for w in ("second", "third")
    ]
    for run in runs:
        engine.execute(run.id)
    engine.close()
    code, out, _ = cli("show", runs[0].id)
    assert code == 0 and "agentruns retry" not in out
    assert f"not retried: run {runs[1].id} of its thread went on without it" in out


def test_show_counts_the_tokens_read_from_and_written_to_the_cache(cli: Cli) -> None:
    # `show` gave "20 in / 10 out" for a run that had used 1,030 tokens (cache reads
    # are most of a real run's input), beside its token budget's "used 1030".
    usage = Usage(
        input_tokens=20,
        output_tokens=10,
        cache_read_input_tokens=900,
        cache_creation_input_tokens=100,
    )
    engine = cli.engine(Agent("cached", ScriptedModel([text("ok")], usage=usage)))
    run = engine.dispatch("cached", {"source": "t", "trigger": "t", "payload": {}})
    assert engine.idle(10)
    engine.close()
    code, out, _ = cli("show", run.id)
    assert code == 0
    assert (
        "usage     1 model steps, 1020 in (900 cache read, 100 cache write) / 10 out tokens" in out
    )
    assert '"ok"  (1020 in (900 cache read, 100 cache write) / 10 out)' in out
