"""Agents the Celery workers of tests/test_celery.py import (``AGENTRUNS_AGENTS``).

Tools append ``<tool> <run id> <pid>`` lines to the file named by
``AGENTRUNS_TEST_LOG``, so a test can count tool calls across worker processes.
Model latency (``AGENTRUNS_TEST_LATENCY``) keeps a run mid-step long enough
for a test to kill or stop the worker that holds it.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from agentruns import Agent, Budget, FatalToolError, ToolContext, tool
from agentruns.models import ScriptedModel, text, tool_use

LATENCY = float(os.environ.get("AGENTRUNS_TEST_LATENCY", "0.4"))


def log(line: str) -> None:
    path = os.environ.get("AGENTRUNS_TEST_LOG")
    if path:
        # One short O_APPEND write per line: lines from several processes don't interleave.
        with open(path, "a") as f:
            f.write(f"{line} {os.getpid()}\n")


@tool
def note(text: str, ctx: ToolContext) -> str:
    """Write a note."""
    log(f"note {ctx.run.id}")
    return f"noted {text}"


@tool(effect=True)
def charge(amount: int, ctx: ToolContext) -> dict[str, Any]:
    """Charge a card: a side effect that must happen once per call."""
    log(f"charge {ctx.run.id}")
    return {"charged": amount, "key": ctx.idempotency_key}


QUICK_SCRIPT = [tool_use("note", {"text": "hello"}), text("Done.")]

quick = Agent(
    "quick",
    ScriptedModel(QUICK_SCRIPT, latency_s=0.02),
    instructions="Take one note.",
    tools=[note],
)

# Long enough to be caught mid-run: the charge comes early, then more model calls.
CHARGE_SCRIPT = [
    tool_use("note", {"text": "before"}),
    tool_use("charge", {"amount": 5}),
    tool_use("note", {"text": "after"}),
    tool_use("note", {"text": "later"}),
    text("Charged."),
]

charger = Agent(
    "charger",
    ScriptedModel(CHARGE_SCRIPT, latency_s=LATENCY),
    instructions="Charge once.",
    tools=[note, charge],
    budget=Budget(max_steps=10),
)


@tool
def report(argv: str) -> str:
    """Run the report command line: bad arguments make argparse exit."""
    parser = argparse.ArgumentParser(prog="report")
    parser.add_argument("--days", type=int, required=True)
    return str(parser.parse_args(argv.split()).days)


# A tool whose code exits (argparse's error on bad arguments, or a sys.exit).
reporter = Agent(
    "reporter",
    ScriptedModel([tool_use("report", {"argv": "--days many"}), text("Reported.")]),
    tools=[report],
)


@tool
def wait_a_while(seconds: float, ctx: ToolContext) -> str:
    """Take a while (a test signals the worker meanwhile)."""
    log(f"wait_a_while {ctx.run.id}")
    time.sleep(seconds)
    return "waited"


waiter = Agent(
    "waiter",
    ScriptedModel([tool_use("wait_a_while", {"seconds": 3}), text("Waited.")]),
    tools=[wait_a_while],
)


@tool(needs_approval=True)
def publish(text: str, ctx: ToolContext) -> str:
    """Publish a note: a person approves it first."""
    log(f"publish {ctx.run.id}")
    return f"published {text}"


def slow_notifier(run: Any, wait: Any, token: str) -> None:
    """A chat webhook that hangs until the test lets it go (the file
    ``AGENTRUNS_TEST_LOG`` + ``.release`` appears), a minute at most."""
    log(f"notifying {run.id}")
    release = f"{os.environ.get('AGENTRUNS_TEST_LOG', '')}.release"
    deadline = time.monotonic() + 60
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.05)
    log(f"notified {run.id}")


asker = Agent(
    "asker",
    ScriptedModel([tool_use("publish", {"text": "news"}), text("Published.")]),
    tools=[publish],
    notifier=slow_notifier,
)


def approving_notifier(run: Any, wait: Any, token: str) -> None:
    """A notifier that answers the approval itself through the worker's engine, once
    the test lets it go (as ``slow_notifier``)."""
    from agentruns.worker import get_engine

    slow_notifier(run, wait, token)
    get_engine().resume(token, approved=True, reason="approved by the notifier")


self_approver = Agent(
    "self_approver",
    ScriptedModel([tool_use("publish", {"text": "news"}), text("Published.")]),
    tools=[publish],
    notifier=approving_notifier,
)


@tool
def decline(ctx: ToolContext) -> str:
    """A call the far side always declines: the run fails on it, however often retried."""
    log(f"decline {ctx.run.id}")
    raise FatalToolError("declined")


decliner = Agent(
    "decliner", ScriptedModel([tool_use("decline", {}), text("Never.")]), tools=[decline]
)
