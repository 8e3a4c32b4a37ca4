"""The CLI's commands: each takes the session and its parsed arguments, returns an exit code."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import redis

from agentruns.cli import render
from agentruns.cli.errors import BAD_INPUT, CliError
from agentruns.cli.session import Session
from agentruns.engine import Engine
from agentruns.errors import first_line
from agentruns.leases import RedisLeases
from agentruns.migrations import HEAD, REVISIONS
from agentruns.runs import Run, RunStatus, utcnow
from agentruns.settings import is_redis_url
from agentruns.store.connect import shown_url

Handler = Callable[[Session, argparse.Namespace], int]


def cmd_migrate(session: Session, args: argparse.Namespace) -> int:
    from agentruns.migrate import migrate

    url = session.settings.database_url
    session.refuse_sqlite_memory()
    revision = migrate(url)
    session.json({"database": shown_url(url), "revision": revision})
    if revision in REVISIONS or revision is None:
        session.say(f"migrated {shown_url(url)} to revision {revision}")
    else:
        session.say(
            f"{shown_url(url)} is at revision {revision}, newer than this release knows"
            f" ({HEAD}), and says this release works on it: nothing to migrate"
        )
    return 0


def cmd_dispatch(session: Session, args: argparse.Namespace) -> int:
    trigger = {
        "source": args.source,
        "trigger": args.trigger,
        "payload": _payload(args.payload),
        "keys": _keys(args.key),
        "thread": args.thread,
    }
    engine = session.engine()
    if args.agent not in engine.agents:
        known = ", ".join(sorted(engine.agents)) or "none"
        raise CliError(
            f"unknown agent {args.agent!r} (known: {known}; AGENTRUNS_AGENTS="
            f"{session.settings.agents})",
            BAD_INPUT,
        )
    session.follow()
    # dispatch() announces a run it stores; a duplicate of an earlier one it only returns.
    stored: set[str] = set()
    stop = engine.on(
        "run.updated",
        lambda e: stored.add(e.run.id) if e.run and e.run.status is RunStatus.QUEUED else None,
    )
    run = engine.dispatch(
        args.agent,
        trigger,
        idempotency_key=args.idempotency_key,
        budget=_budget(args.budget),
    )
    stop()
    if run.id not in stored:
        session.say(f"already dispatched with this idempotency key: run {run.id}")
    elif run.id not in session.shown:  # else follow() has said so
        session.say(f"dispatched run {run.id} ({run.agent})")
    session.settle()
    return _report_run(session, engine.get_run(run.id))


def cmd_runs(session: Session, args: argparse.Namespace) -> int:
    engine = session.engine(read_only=True)
    runs = engine.list_runs(status=args.status, agent=args.agent, limit=args.limit)
    session.json({"runs": [render.run_json(r) for r in runs]})
    session.say(render.runs_table(runs))
    return 0


def cmd_show(session: Session, args: argparse.Namespace) -> int:
    engine = session.engine(read_only=True)
    run = engine.get_run(args.run)
    steps = engine.steps(run.id)
    session.json({"run": render.run_json(run, steps)})
    unsettled = run.status in (RunStatus.RUNNING, RunStatus.QUEUED)
    losses, hold = engine.hold(run.id) if unsettled else (0, None)
    if hold is not None and _given_up(session, engine, run.id):
        hold = None  # let go by a live worker: recover requeues it at once
    failed_in_thread = run.status is RunStatus.FAILED and run.thread is not None
    went_on = engine.store.thread_went_on(run.id) if failed_in_thread else None
    session.say(render.header(run, losses, hold, went_on))
    session.say()
    session.say(render.timeline(run, steps))
    return 0


def cmd_answer(session: Session, args: argparse.Namespace) -> int:
    """``approve`` and ``deny``: answer an approval by its token, or by the run it holds."""
    approved = args.command == "approve"
    if args.approval is not None and args.run is None:
        raise CliError(
            f"{args.command}: --approval goes with --run (a token names its own)", BAD_INPUT
        )
    if (args.token is None) == (args.run is None):
        raise CliError(f"{args.command}: give either a TOKEN or --run RUN", BAD_INPUT)
    engine = session.engine()
    if args.token is None:
        run = engine.get_run(args.run)
        if run.status is not RunStatus.WAITING:
            raise CliError(
                f"run {run.id} is {run.status.value}, not waiting on an approval", BAD_INPUT
            )
    # A token pasted from a message often brings a newline or spaces; it has neither.
    if args.token == "-":
        token = sys.stdin.readline().strip()
    elif args.token is not None:
        token = args.token.strip()
    else:
        token = engine.approval_token(args.run, approval_id=args.approval)
    session.follow()
    run = engine.resume(token, approved=approved, reason=args.reason)
    asked = next((s for s in reversed(engine.steps(run.id)) if s.kind == "wait"), None)
    what = f"{asked.name}({render.short(asked.input, 60)})" if asked else "the call"
    session.say(f"{'approved' if approved else 'denied'} {what} on run {run.id}")
    session.settle()
    return _report_run(session, engine.get_run(run.id))


def cmd_cancel(session: Session, args: argparse.Namespace) -> int:
    engine = session.engine()
    before = engine.get_run(args.run)
    session.follow()
    run = engine.cancel(args.run)
    session.raise_reported()
    session.json({"run": render.run_json(run)})
    if session.shown.get(run.id) != run.status.value:  # else follow() has said so
        session.say(render.run_line(run))
    if before.status.is_final:
        # Said, or a second cancel (or one of a completed run) reads as if it had acted.
        session.say(f"it was already {before.status.value}: a final run stays as it is")
    elif run.status is RunStatus.RUNNING:
        session.say(_cancel_requested(_unheld(engine, run.id)))
    # The cancel freed its run's thread or concurrency key: the next run in that line
    # may have started here (embedded), to run until it ends or waits, not be cut off.
    session.settle()
    return 0


def _cancel_requested(unheld: bool | None) -> str:
    if unheld:
        return (
            "cancel requested: no worker holds it now (its worker died, or let it go in an"
            " outage); it settles cancelled when recover() takes it, once its claim expires"
        )
    stops = (
        "cancel requested: the execution holding it stops within about a second"
        " (a tool call in progress first returns: its ctx.signal is set)"
    )
    if unheld is None:  # another process's local lease: this one cannot tell if it lives
        stops += (
            "; if the process running it died, it settles cancelled when `agentruns"
            " recover` takes it, once its claim expires"
        )
    return stops


def cmd_retry(session: Session, args: argparse.Namespace) -> int:
    engine = session.engine()
    before = engine.get_run(args.run)
    session.follow()
    run = engine.retry(args.run, budget=_budget(args.budget))
    session.raise_reported()
    if before.status is RunStatus.QUEUED:
        session.say(f"run {run.id} is queued already: sent to the workers again")
    else:
        session.say(f"retrying run {run.id} ({run.agent}) from its latest checkpoint")
    session.settle()
    return _report_run(session, engine.get_run(run.id))


def cmd_recover(session: Session, args: argparse.Namespace) -> int:
    engine = session.engine()
    session.follow()
    requeued = engine.recover()
    session.raise_reported()
    session.say(f"recover: requeued {len(requeued)} run(s)")
    session.settle()
    runs = [engine.get_run(run_id) for run_id in requeued]
    session.json({"requeued": requeued, "runs": [render.run_json(r) for r in runs]})
    for run in runs:
        session.say("  " + render.run_line(run))
    return 0


def cmd_tick(session: Session, args: argparse.Namespace) -> int:
    engine = session.engine()
    now = utcnow()
    before = engine.list_runs(status=RunStatus.WAITING, limit=100_000)
    session.follow()
    engine.tick(wait_for_notifiers=False)  # settle waits for them, for so long
    session.raise_reported()
    session.settle(warn_notifiers=False)  # said below
    after = {r.id: r for r in engine.list_runs(status=RunStatus.WAITING, limit=100_000)}
    expired = [r.id for r in before if r.waiting and r.waiting.expires_at <= now]
    expired = [run_id for run_id in expired if run_id not in after]
    notified = [
        r.id
        for r in before
        if r.waiting and r.waiting.notified_at is None and r.id in after
        if (w := after[r.id].waiting) is not None and w.notified_at is not None
    ]
    # What went wrong in a notifier (the engine reported it and went on with the rest).
    errors = [first_line(exc, typed=False) for exc in session.reported]
    session.json(
        {"expired": expired, "notified": notified, "waiting": len(after), "errors": errors}
    )
    session.say(
        f"tick: {len(expired)} expired approval(s) denied, {len(notified)} notification(s) "
        f"sent, {len(after)} run(s) waiting"
    )
    if errors:
        failed = render.plain(errors[0])  # a notifier's own words
        session.say(f"tick: {len(errors)} failed, the next tick tries again: {failed}")
    return 0


def cmd_demo(session: Session, args: argparse.Namespace) -> int:
    from agentruns.demo import run_demo

    return run_demo(as_json=session.as_json, out=session.out)


def cmd_watch(session: Session, args: argparse.Namespace) -> int:
    from agentruns.cli.watch import watch

    return watch(session, run_id=args.run, until_final=args.until_final, interval=args.interval)


# -- helpers ---------------------------------------------------------------------


def _payload(raw: str | None, option: str = "--payload") -> Any:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CliError(f"{option} is not JSON: {exc}", BAD_INPUT) from None


def _budget(raw: str | None) -> dict[str, Any] | None:
    budget = _payload(raw, "--budget")
    if budget is not None and not isinstance(budget, dict):
        raise CliError(f"--budget takes a JSON object of limits, not {raw}", BAD_INPUT)
    return budget


def _keys(pairs: list[str]) -> dict[str, str]:
    keys: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise CliError(f"--key takes name=value, not {pair!r}", BAD_INPUT)
        if name in keys and keys[name] != value:
            raise CliError(f"--key {name} is given twice: {keys[name]!r} and {value!r}", BAD_INPUT)
        keys[name] = value
    return keys


def _report_run(session: Session, run: Run) -> int:
    """The run as it stands after a command that may have executed it here."""
    token = None
    if run.status is RunStatus.WAITING and session.settings.secret:
        # Without a shared secret, a token is good only in this process, which ends
        # now: none is offered (it failed with bad_signature wherever it was used).
        token = session.engine().approval_token(run.id)
    session.json({"run": render.run_json(run), "approval_token": token})
    if not session.embedded and run.status is RunStatus.QUEUED:
        session.say(f"queued for a worker; follow it with `agentruns watch --run {run.id}`")
        return 0
    if session.shown.get(run.id) != run.status.value:
        session.say(render.run_line(run))
    if token is not None:
        session.say(f"  approve: agentruns approve {token}")
        session.say(f"  or:      {render.answer_by_run(run)}")
    elif run.status is RunStatus.WAITING:
        session.say(f"  answer:  {render.answer_by_run(run)}")
        session.say("  (AGENTRUNS_SECRET is unset, so no token is given: one would work only here)")
    return 0


def _given_up(session: Session, engine: Engine, run_id: str) -> bool:
    """Did a live worker let the run's claim go (an outage, a lost lease)? A note in
    Redis, which reads leave out of their engine: asked here, briefly, of the Redis
    workers take their leases from (the broker's, without AGENTRUNS_REDIS_URL)."""
    settings = session.settings
    broker = settings.broker_url if is_redis_url(settings.broker_url) else None
    url = settings.redis_url or broker
    ref = engine.store.run_ref(run_id)
    if not url or ref is None:
        return False
    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        return RedisLeases(url, client=client).given_up(run_id, ref.epoch)
    except redis.RedisError:
        return False  # unknown: the hold shown is recover's for a run lost with its worker
    finally:
        client.close()


def _unheld(engine: Engine, run_id: str) -> bool | None:
    """Whether no process holds the run's lease; None if this process cannot see it
    (another's local lease)."""
    if getattr(engine.leases, "process_local", False):
        return None
    try:
        if engine.leases.holder(run_id) is not None:
            return False
        # Its owner may have stopped it since the cancel, and let its lease go.
        return engine.get_run(run_id).status is RunStatus.RUNNING
    except Exception:
        return False  # Redis down: say what is most likely
