"""agentruns: durable LLM agent runs on Celery (see SPEC.md §2 for these names)."""

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
