"""agentruns: durable LLM agent runs on Celery (see SPEC.md §2 for these names).

The names are imported when first asked for: ``import agentruns`` alone loads
nothing heavy, so the ``agentruns`` command can say a Ctrl-C during its start in
one line (its imports of SQLAlchemy, Celery and pydantic take a second).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentruns.agent import Agent, RunContext
    from agentruns.engine import Engine
    from agentruns.errors import (
        AgentrunsError,
        FatalToolError,
        InvalidTokenError,
        InvalidTriggerError,
        LeaseLostError,
        RunNotFoundError,
        UnknownAgentError,
    )
    from agentruns.leases import LocalLeases, RedisLeases
    from agentruns.runs import (
        Budget,
        Checkpoint,
        Claim,
        Run,
        RunError,
        RunStatus,
        Step,
        TriggerEnvelope,
        Usage,
        WaitPoint,
    )
    from agentruns.schedulers import CeleryScheduler, LocalScheduler
    from agentruns.store import SqlStore
    from agentruns.tools import ToolContext, tool

# Each public name and the module it comes from.
_HOMES = {
    "Agent": "agentruns.agent",
    "RunContext": "agentruns.agent",
    "Engine": "agentruns.engine",
    "AgentrunsError": "agentruns.errors",
    "FatalToolError": "agentruns.errors",
    "InvalidTokenError": "agentruns.errors",
    "InvalidTriggerError": "agentruns.errors",
    "LeaseLostError": "agentruns.errors",
    "RunNotFoundError": "agentruns.errors",
    "UnknownAgentError": "agentruns.errors",
    "LocalLeases": "agentruns.leases",
    "RedisLeases": "agentruns.leases",
    "Budget": "agentruns.runs",
    "Checkpoint": "agentruns.runs",
    "Claim": "agentruns.runs",
    "Run": "agentruns.runs",
    "RunError": "agentruns.runs",
    "RunStatus": "agentruns.runs",
    "Step": "agentruns.runs",
    "TriggerEnvelope": "agentruns.runs",
    "Usage": "agentruns.runs",
    "WaitPoint": "agentruns.runs",
    "CeleryScheduler": "agentruns.schedulers",
    "LocalScheduler": "agentruns.schedulers",
    "SqlStore": "agentruns.store",
    "ToolContext": "agentruns.tools",
    "tool": "agentruns.tools",
}


if not TYPE_CHECKING:
    # Hidden from type checkers: a module __getattr__ would make any misspelt name
    # (agentruns.Engnie) pass; the names are the ones imported above for them.

    def __getattr__(name: str) -> object:
        home = _HOMES.get(name)
        if home is not None:
            value: object = getattr(importlib.import_module(home), name)
        elif (
            not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None
        ):
            # A subpackage asked for as an attribute (agentruns.models.ScriptedModel
            # after a bare import agentruns), as when this module imported them all.
            value = importlib.import_module(f"{__name__}.{name}")
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *_HOMES})


__all__ = [
    "Agent",
    "AgentrunsError",
    "Budget",
    "CeleryScheduler",
    "Checkpoint",
    "Claim",
    "Engine",
    "FatalToolError",
    "InvalidTokenError",
    "InvalidTriggerError",
    "LeaseLostError",
    "LocalLeases",
    "LocalScheduler",
    "RedisLeases",
    "Run",
    "RunContext",
    "RunError",
    "RunNotFoundError",
    "RunStatus",
    "SqlStore",
    "Step",
    "ToolContext",
    "TriggerEnvelope",
    "UnknownAgentError",
    "Usage",
    "WaitPoint",
    "tool",
]
