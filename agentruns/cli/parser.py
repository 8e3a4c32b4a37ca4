"""The CLI's arguments (SPEC §8)."""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn

from agentruns.cli import commands
from agentruns.intake import MAX_LIMIT
from agentruns.runs import RunStatus

_BUDGET_HELP = (
    'limits to replace, as JSON: {"max_steps": 40, "max_tokens": 500000, "timeout_s": 600}'
)


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit 2."""

    def error(self, message: str) -> NoReturn:
        print(f"agentruns: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


# Bounds of watch's --interval: below, a watch spends a database read on each few
# milliseconds; above, the time of its next look overflows ("timestamp out of range").
INTERVAL = (0.05, 86400.0)


def _interval(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan  # refused below, in the same words
    low, high = INTERVAL
    if not low <= number <= high:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"must be from {low:g} to {high:g} seconds, not {value!r}")
    return number


def _limit(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {value!r}") from None
    if not 1 <= number <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"must be from 1 to {MAX_LIMIT}, not {value}")
    return number


def build() -> Parser:
    common = Parser(add_help=False)
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    parser = Parser(
        prog="agentruns",
        description="Durable LLM agent runs: dispatch, inspect, approve and recover them.",
        epilog="Settings come from AGENTRUNS_* environment variables (see the README).",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, help: str, handler: commands.Handler) -> Parser:
        p: Parser = sub.add_parser(name, help=help, description=help, parents=[common])
        p.set_defaults(handler=handler)
        return p

    command("demo", "the example agent end to end: approval, crash, recovery", commands.cmd_demo)
    command("migrate", "create or upgrade the database schema", commands.cmd_migrate)

    p = command("dispatch", "start a run of an agent", commands.cmd_dispatch)
    p.add_argument("agent", help="the agent's name")
    p.add_argument("--payload", metavar="JSON", help="the trigger payload, as JSON")
    p.add_argument("--source", default="cli", help="where the trigger came from (default: cli)")
    p.add_argument("--trigger", default="manual", help="what happened (default: manual)")
    p.add_argument(
        "--key", action="append", default=[], metavar="NAME=VALUE", help="a correlation key"
    )
    p.add_argument("--thread", help="continue the conversation of this thread")
    p.add_argument("--idempotency-key", help="the same key returns the same run")
    p.add_argument("--budget", metavar="JSON", help=_BUDGET_HELP + " (default: the agent's)")

    p = command("runs", "list runs, newest first", commands.cmd_runs)
    p.add_argument("--status", choices=[s.value for s in RunStatus])
    p.add_argument("--agent")
    p.add_argument("--limit", type=_limit, default=20)

    p = command("show", "a run, its steps as a timeline, and its usage", commands.cmd_show)
    p.add_argument("run", metavar="RUN")

    for name, verb in (("approve", "approve"), ("deny", "deny")):
        p = command(name, f"{verb} the tool call a run is waiting on", commands.cmd_answer)
        p.add_argument(
            "token",
            nargs="?",
            metavar="TOKEN",
            help="the resume token; - reads it from stdin (out of ps and shell history)",
        )
        p.add_argument("--run", metavar="RUN", help="mint the run's current token with the secret")
        p.add_argument(
            "--approval",
            metavar="ID",
            help="with --run: only if it still waits on this approval (`show` gives its id)",
        )
        p.add_argument("--reason", help="recorded in the wait step; a denial tells the model")

    p = command("cancel", "cancel a run", commands.cmd_cancel)
    p.add_argument("run", metavar="RUN")

    p = command("retry", "queue a failed run again, from its latest checkpoint", commands.cmd_retry)
    p.add_argument("run", metavar="RUN")
    p.add_argument("--budget", metavar="JSON", help=_BUDGET_HELP + " (default: the run's)")

    command("recover", "requeue interrupted, crashed and lost runs", commands.cmd_recover)
    command("tick", "expire old approvals, re-send notifications", commands.cmd_tick)

    p = command("watch", "follow runs live: status changes and new steps", commands.cmd_watch)
    p.add_argument("--run", metavar="RUN", help="only this run, from its first step")
    p.add_argument("--until-final", action="store_true", help="stop once the runs settle")
    p.add_argument(
        "--interval", type=_interval, default=0.5, help="seconds between polls, 0.05 to 86400"
    )
    return parser
