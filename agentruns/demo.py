"""``agentruns demo``: one run of the example triage agent, with an approval and a real crash.

Embedded default throughout: a fresh SQLite file, in-process leases and
scheduler, ``ScriptedModel`` unless ``ANTHROPIC_API_KEY`` is set. After the
approval the run is handed to a child process (``python -m agentruns.demo
--child``), which this process kills with SIGKILL in the middle of a model call;
``recover()`` then finishes the run here from its last checkpoint.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

from agentruns.cli import render
from agentruns.engine import Engine
from agentruns.errors import InvalidTokenError
from agentruns.leases import LocalLeases
from agentruns.migrate import migrate
from agentruns.runs import Run, RunStatus, Step, utcnow
from agentruns.schedulers import LocalScheduler
from agentruns.store import SqlStore
from agentruns.wiring import cwd_on_path

LEASE_TTL = 1.0  # short, so the crashed child's claim expires quickly
PARENT_LATENCY = 0.1  # per model call: slow enough to watch, fast enough to finish
CHILD_LATENCY = 0.8  # per model call in the child: the window the crash lands in
TRIGGER: dict[str, Any] = {
    "source": "github",
    "trigger": "issues.opened",
    "id": "gh-delivery-7f3a",
    "keys": {"repo": "acme/app", "issue": "ACME-142"},
    "payload": {
        "issue": "ACME-142",
        "title": "App crashes on start after upgrading to 2.3",
        "body": "Since 2.3 the app closes right after the splash screen.",
    },
}


class DemoError(Exception):
    """The demo did not go as it should; the message says where."""


class _HandOff(LocalScheduler):
    """Runs executions here, except while ``hold`` is set: then the run stays queued."""

    hold = False

    def schedule(self, run_id: str) -> None:
        if not self.hold:
            super().schedule(run_id)


class _Narrator:
    """Prints what happens, each step once, whether seen as an event or in the store."""

    def __init__(self, out: TextIO, quiet: bool) -> None:
        self.out = out
        self.quiet = quiet
        self.t0 = time.monotonic()
        self.steps: set[int] = set()
        self.status: RunStatus | None = None
        self._lock = threading.Lock()

    def say(self, text: str = "") -> None:
        if not self.quiet:
            with self._lock:
                print(text, file=self.out, flush=True)

    def headline(self, text: str) -> None:
        self.say()
        self.say(f"== {text}")

    def event(self, text: str, who: str = "") -> None:
        elapsed = time.monotonic() - self.t0
        self.say(f"  {elapsed:6.2f}s {who:<7} {text}")

    def step(self, step: Step, who: str = "") -> None:
        with self._lock:
            if step.index in self.steps:
                return
            self.steps.add(step.index)
        self.event(render.step_line(step), who)

    def run(self, run: Run, who: str = "") -> None:
        with self._lock:
            if run.status is self.status:
                return
            self.status = run.status
        self.event(render.run_line(run), who)


def _import_triage() -> ModuleType:
    cwd_on_path()
    try:
        import workers.triage as triage
    except ImportError as exc:
        raise DemoError(
            f"cannot import workers.triage ({exc}): run the demo from the project directory"
        ) from None
    return triage


def run_demo(*, as_json: bool = False, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    try:
        summary = _demo(_Narrator(out, quiet=as_json))
    except DemoError as exc:
        print(f"agentruns: error: demo failed: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(render.as_json(summary), file=out)
    return 0


def _demo(say: _Narrator) -> dict[str, Any]:
    triage = _import_triage()
    real_model = bool(os.environ.get("ANTHROPIC_API_KEY"))
    folder = Path(tempfile.mkdtemp(prefix="agentruns-demo-"))
    url = f"sqlite:///{folder / 'demo.db'}"
    say.say("agentruns demo: the triage agent from workers/triage.py, on the embedded default")
    say.say(f"  database  {url} (fresh), in-process leases and scheduler")
    model = "Claude (ANTHROPIC_API_KEY is set)" if real_model else "ScriptedModel (no network)"
    say.say(f"  model     {model}")
    migrate(url)

    agent = triage.make_agent(None if real_model else triage.scripted_model(PARENT_LATENCY))
    scheduler = _HandOff()
    reported: list[Exception] = []
    engine = Engine(
        SqlStore(url),
        leases=LocalLeases(),
        scheduler=scheduler,
        agents=[agent],
        secret=secrets.token_urlsafe(32),
        lease_ttl=LEASE_TTL,
        on_error=reported.append,
    )
    engine.on("step.appended", lambda e: say.step(e.step) if e.step else None)
    engine.on("run.updated", lambda e: say.run(e.run) if e.run else None)
    try:
        run = _first_execution(engine, say)
        _approve(engine, scheduler, run, say)
        crashed_at = _crash(url, run, triage, real_model, say)
        run = _recover(engine, scheduler, run, say)
        checks = _check(engine, run, triage, real_model, say)
        steps = engine.steps(run.id)
        say.headline("timeline")
        say.say(render.header(run))
        say.say()
        say.say(render.timeline(run, steps))
        say.say()
        say.say(f"explore it: AGENTRUNS_DATABASE_URL={url} {_command()} show {run.id}")
    finally:
        engine.close()
    return {
        "database": url,
        "crashed_at_step": crashed_at,
        "checks": checks,
        "run": render.run_json(run, steps),
    }


def _command() -> str:
    """How to call the CLI from here: the virtualenv's console script if there is one."""
    script = Path(sys.executable).parent / "agentruns"
    if not script.exists():
        return "agentruns"
    try:
        return str(script.relative_to(Path.cwd()))
    except ValueError:
        return str(script)


def _first_execution(engine: Engine, say: _Narrator) -> Run:
    say.headline("1. dispatch: a bug report arrives")
    run = engine.dispatch("triage", TRIGGER)
    engine.idle()
    run = engine.get_run(run.id)
    if run.status is not RunStatus.WAITING or run.waiting is None:
        raise DemoError(f"the run should wait for an approval, it is {render.run_line(run)}")
    return run


def _approve(engine: Engine, scheduler: _HandOff, run: Run, say: _Narrator) -> None:
    say.headline("2. approval: post_comment is an effect tool that needs a person's yes")
    token = engine.approval_token(run.id)
    say.say(f"  resume token (signed, expires, single use):\n    {token}")
    scheduler.hold = True  # the next execution is the child's
    engine.resume(token, approved=True, reason="the comment reads well")
    say.event("engine.resume(token, approved=True): the run is queued again")
    try:
        engine.resume(token, approved=True)
        raise DemoError("a used token was accepted again")
    except InvalidTokenError as exc:
        say.event(f"the same token again is refused: {exc.reason}")


def _crash(url: str, run: Run, triage: ModuleType, real_model: bool, say: _Narrator) -> int | None:
    """Let a child process execute the run; SIGKILL it inside a model call. The step it died in."""
    say.headline("3. crash: a worker process takes the run and is killed mid-step")
    child = _spawn_child(url, run.id, triage)
    who = f"pid {child.pid}"
    say.event(f"child process {child.pid} executes the run", who)
    store = SqlStore(url)
    try:
        crashed_at = _kill_mid_step(child, store, run.id, real_model, say, who)
    finally:
        store.close()
        if child.poll() is None:
            child.kill()
            child.wait()
    if crashed_at is None:
        if child.returncode:
            errors = (child.stderr.read() if child.stderr else "").strip().splitlines()
            raise DemoError(f"the child failed: {errors[-1] if errors else child.returncode}")
        say.event("the child finished the run before the crash point (no crash this time)", who)
    return crashed_at


def _spawn_child(url: str, run_id: str, triage: ModuleType) -> subprocess.Popen[str]:
    env = dict(os.environ)
    root = str(Path(str(triage.__file__)).resolve().parent.parent)  # where `workers` lives
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, "-m", "agentruns.demo", "--child", url, run_id],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _kill_mid_step(
    child: subprocess.Popen[str],
    store: SqlStore,
    run_id: str,
    real_model: bool,
    say: _Narrator,
    who: str,
) -> int | None:
    """Watch the store; once the child saved a model step and ran its tools, kill it."""
    seen_llm = False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and child.poll() is None:
        steps = store.steps(run_id)
        for step in steps:
            if step.index not in say.steps:
                say.step(step, who)
                seen_llm = seen_llm or step.kind == "llm"
        current = store.get_run(run_id)
        say.run(current, who)
        # Its tools done after a model step of its own: it is inside the next model call.
        if seen_llm and current.status is RunStatus.RUNNING and steps[-1].kind == "tool":
            time.sleep(0.1 if real_model else CHILD_LATENCY / 4)
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
            last = steps[-1].index
            say.event(f"CRASH: kill -9 {child.pid} during the model call after step {last}", who)
            if current.claim is not None:
                say.event(
                    f"the store still says running, claimed by {current.claim.owner} "
                    f"until {render.clock(current.claim.expires_at)}"
                )
            return last
        time.sleep(0.02)
    return None


def _recover(engine: Engine, scheduler: _HandOff, run: Run, say: _Narrator) -> Run:
    say.headline("4. recovery: recover() requeues it once the dead worker's claim expires")
    scheduler.hold = False
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        current = engine.get_run(run.id)
        if current.status is not RunStatus.RUNNING:
            break
        claim = current.claim
        if claim is None or claim.expires_at <= utcnow():
            requeued = engine.recover()
            if run.id in requeued:
                say.event(f"engine.recover() requeued {run.id}: it goes on from its checkpoint")
                break
        time.sleep(0.1)
    if not engine.idle(60):
        raise DemoError("the recovered run did not settle in a minute")
    run = engine.get_run(run.id)
    if run.status is not RunStatus.COMPLETED:
        raise DemoError(f"the run should have completed: {render.run_line(run)}")
    say.headline(f"5. completed: {run.output}")
    return run


def _check(
    engine: Engine, run: Run, triage: ModuleType, real_model: bool, say: _Narrator
) -> dict[str, Any]:
    steps = engine.steps(run.id)
    indexes = [s.index for s in steps]
    llm = sum(1 for s in steps if s.kind == "llm")
    comments = sum(1 for s in steps if s.kind == "tool" and s.name == "post_comment")
    checks = {
        "llm_steps": llm,
        "script_length": None if real_model else triage.SCRIPT_LENGTH,
        "dense_indexes": indexes == list(range(len(steps))),
        "post_comment_runs": comments,
    }
    ok = checks["dense_indexes"] and comments == 1
    if not real_model:
        ok = ok and llm == triage.SCRIPT_LENGTH == run.steps_used
        say.say(
            f"  check: {llm} model steps for a script of {triage.SCRIPT_LENGTH} responses: "
            "no model call whose response was saved was made again"
        )
    say.say(f"  check: step indexes 0..{len(steps) - 1}, dense, none repeated")
    say.say(f"  check: post_comment ran {comments} time (an effect tool runs once)")
    if not ok:
        raise DemoError(f"the checks failed: {checks}")
    return checks


def _child(url: str, run_id: str, latency: float) -> int:
    """The process that gets killed: executes the run with a slow model."""
    triage = _import_triage()
    model = None if os.environ.get("ANTHROPIC_API_KEY") else triage.scripted_model(latency)
    engine = Engine(
        SqlStore(url),
        leases=LocalLeases(),
        scheduler=LocalScheduler(),
        agents=[triage.make_agent(model)],
        secret=secrets.token_urlsafe(32),
        lease_ttl=LEASE_TTL,
    )
    try:
        engine.execute(run_id)
    finally:
        engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentruns.demo")
    parser.add_argument("--child", nargs=2, metavar=("URL", "RUN"))
    parser.add_argument("--latency", type=float, default=CHILD_LATENCY, help="per model call")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child[0], args.child[1], args.latency)
    return run_demo(as_json=args.json)


if __name__ == "__main__":
    raise SystemExit(main())
