"""Agents shared by tests and the helper processes they kill, stop and restart.

Tools append lines to the file named by ``AGENTRUNS_TEST_LOG`` so a test can
count calls across processes. ``AGENTRUNS_TEST_HANG`` names a tool that hangs
in the process where it is set (so the test can kill it at that point);
``AGENTRUNS_TEST_PAUSE`` one that takes a second (so the test can stop it there),
``AGENTRUNS_TEST_FAIL`` one that then raises, and ``AGENTRUNS_TEST_FATAL`` one that
raises ``FatalToolError``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from agentruns import Agent, Budget, FatalToolError, ToolContext, tool
from agentruns.models import ScriptedModel, text, tool_use
from agentruns.tools import Tool


def log(line: str) -> None:
    path = os.environ.get("AGENTRUNS_TEST_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())


def hang_here(name: str) -> None:
    if os.environ.get("AGENTRUNS_TEST_HANG") == name:
        log(f"hanging {name}")
        time.sleep(3600)
    if os.environ.get("AGENTRUNS_TEST_PAUSE") == name:
        time.sleep(1.0)
    if os.environ.get("AGENTRUNS_TEST_FAIL") == name:
        raise RuntimeError("gateway timeout: not charged")
    if os.environ.get("AGENTRUNS_TEST_FATAL") == name:
        raise FatalToolError("declined: nothing charged this time")


@tool
def note(text: str) -> str:
    """Write a note."""
    log(f"note {text}")
    hang_here("note")
    return f"noted {text}"


@tool
def slow() -> str:
    """Take a while."""
    log("slow")
    hang_here("slow")
    return "slow done"


@tool(effect=True)
def charge(amount: int, ctx: ToolContext) -> dict[str, Any]:
    """Charge a card: a side effect that must happen once."""
    log(f"charge {ctx.idempotency_key}")
    hang_here("charge")
    return {"charged": amount, "key": ctx.idempotency_key}


def _charged(amount: int, ctx: ToolContext) -> dict[str, Any]:
    """What the charge tools below do: log the call (a test can kill it here), charge."""
    log(f"charge {ctx.idempotency_key}")
    hang_here("charge")
    return {"charged": amount}


@tool(effect=True, on_unknown="fail")
def charge_or_fail(amount: int, ctx: ToolContext) -> dict[str, Any]:
    """Charge, failing the run if a crash leaves the outcome unknown."""
    return _charged(amount, ctx)


@tool(effect=True, on_unknown="approve")
def charge_or_ask(amount: int, ctx: ToolContext) -> dict[str, Any]:
    """Charge, asking a human whether to charge again if a crash leaves the outcome unknown."""
    return _charged(amount, ctx)


@tool(effect=True, needs_approval=True, on_unknown="fail")
def approved_charge_or_fail(amount: int, ctx: ToolContext) -> dict[str, Any]:
    """Charge once a human approves; fail the run if a crash leaves the outcome unknown."""
    return _charged(amount, ctx)


@tool(effect=True, needs_approval=True, on_unknown="approve")
def approved_charge_or_ask(amount: int, ctx: ToolContext) -> dict[str, Any]:
    """Charge once a human approves; ask again if a crash leaves the outcome unknown."""
    return _charged(amount, ctx)


STEPS = [
    tool_use("note", {"text": "one"}),
    tool_use("note", {"text": "two"}),
    tool_use("note", {"text": "three"}),
    text("Done."),
]

# Model latency lets a test act while a model call is in flight.
LATENCY = float(os.environ.get("AGENTRUNS_TEST_LATENCY", "0.3"))

steps_agent = Agent(
    "steps",
    ScriptedModel(STEPS, latency_s=LATENCY),
    instructions="Take notes.",
    tools=[note],
    budget=Budget(max_steps=10),
)

effect_agent = Agent(
    "effects",
    ScriptedModel([[tool_use("charge", {"amount": 5}), tool_use("slow", {})], text("Charged.")]),
    tools=[charge, slow],
)


@tool
def first(ctx: ToolContext) -> str:
    """Take a second (with AGENTRUNS_TEST_PAUSE=first), then say whether to go on."""
    hang_here("first")
    log(f"first {os.getpid()} signal {ctx.signal.is_set()}")
    return "first done"


@tool
def second() -> str:
    """Act on the outside world: once, by the run's holder."""
    log(f"second {os.getpid()}")
    return "second done"


# Two calls in one step: a process stopped in the first goes on past its lease.
two_calls_agent = Agent(
    "two_calls",
    ScriptedModel([[tool_use("first", {}), tool_use("second", {})], text("Done.")]),
    tools=[first, second],
)


@tool(needs_approval=True)
def publish(text: str) -> str:
    """Publish a text (a person approves it first)."""
    return "published"


def _pager_down(run: Any, wait: Any, token: str) -> None:
    raise ConnectionRefusedError("the pager is down")  # an OSError, as a webhook's are


# Its notifier always fails: tick retries it, and says so.
pager_agent = Agent(
    "pager",
    ScriptedModel([tool_use("publish", {"text": "hi"}), text("Published.")]),
    tools=[publish],
    notifier=_pager_down,
)


# What a notifier that hangs (AGENTRUNS_TEST_HANG=notifier) waits for: a test sets it
# as it ends, so the call it left under way returns.
notifier_released = threading.Event()


def _pager_hangs(run: Any, wait: Any, token: str) -> None:
    if os.environ.get("AGENTRUNS_TEST_HANG") == "notifier":
        log(f"hanging notifier of {run.id}")
        notifier_released.wait(600)


# Its notifier hangs where AGENTRUNS_TEST_HANG=notifier: a webhook without a timeout.
hung_pager_agent = Agent(
    "hung_pager",
    ScriptedModel([tool_use("publish", {"text": "hi"}), text("Published.")]),
    tools=[publish],
    notifier=_pager_hangs,
)


@tool
def crash() -> str:
    """End this process at once, as a segfault or an out-of-memory kill would."""
    log("crash")
    os.kill(os.getpid(), signal.SIGKILL)
    return "never"


# Its one tool call kills the worker that makes it, on every recovery.
crash_agent = Agent("crash", ScriptedModel([tool_use("crash", {}), text("Never.")]), tools=[crash])


def _charging(name: str, charger: Tool) -> Agent:
    """An agent whose model makes one charge with ``charger``, then answers."""
    script = [tool_use(charger.name, {"amount": 7}), text("Charged.")]
    return Agent(name, ScriptedModel(script), tools=[charger])


unknown_retry_agent = _charging("unknown_retry", charge)
unknown_fail_agent = _charging("unknown_fail", charge_or_fail)
unknown_approve_agent = _charging("unknown_approve", charge_or_ask)
approved_fail_agent = _charging("approved_fail", approved_charge_or_fail)
approved_ask_agent = _charging("approved_ask", approved_charge_or_ask)

AGENTS = [
    steps_agent,
    effect_agent,
    two_calls_agent,
    crash_agent,
    unknown_retry_agent,
    unknown_fail_agent,
    unknown_approve_agent,
    approved_fail_agent,
    approved_ask_agent,
]
