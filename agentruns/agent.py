"""Agents: a model, instructions, tools and the limits of a run."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pydantic import BaseModel

from agentruns.models.base import Model
from agentruns.runs import Budget, Run, TriggerEnvelope, WaitPoint, is_storable_key
from agentruns.store.schema import AGENT_NAME_LENGTH
from agentruns.tools import STATE_TOOL_NAMES, Tool, as_tool

# The longest approval wait an agent may set: about a century, a date for any run.
MAX_APPROVAL_TTL = timedelta(days=36_500)

ToolLike = Tool | Callable[..., Any]
Notifier = Callable[[Run, WaitPoint, str], None]


@dataclass(frozen=True)
class RunContext:
    run_id: str
    agent: str
    trigger: TriggerEnvelope
    thread: str | None
    signal: threading.Event


class Agent:
    """What to run: see SPEC §3 for every argument."""

    def __init__(
        self,
        name: str,
        model: Model,
        instructions: str | Callable[[RunContext], str] = "",
        tools: Sequence[ToolLike] | Callable[[RunContext], Sequence[ToolLike]] = (),
        budget: Budget | dict[str, Any] | None = None,
        approval_ttl: timedelta = timedelta(hours=24),
        notifier: Notifier | None = None,
        concurrency_key: str | Callable[[TriggerEnvelope], str | None] | None = None,
        state: type[BaseModel] | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"an agent needs a name (text), not {name!r}")
        # Checked here: every store must hold it, and hold it alike (Postgres refused
        # what SQLite kept), and the CLI shows it as it is.
        if len(name) > AGENT_NAME_LENGTH:
            raise ValueError(
                f"an agent's name is at most {AGENT_NAME_LENGTH} characters, not {len(name)}"
            )
        if not name.isprintable() or name.strip() != name:
            # (Not printable: control characters, NUL, lone surrogates from undecodable bytes.)
            raise ValueError(
                f"an agent's name must be printable text with no space around it, not {name!r}"
            )
        self.name = name
        # Checked here, as budget and approval_ttl below: a wrong one would otherwise
        # fail every execution of every run, or every dispatch.
        if not callable(getattr(model, "complete", None)):
            raise TypeError(
                f"agent {name!r}: model must be a Model (with complete(request, signal)),"
                f" not {model!r}"
            )
        self.model = model
        if instructions is None:
            instructions = ""
        if not isinstance(instructions, str) and not callable(instructions):
            raise TypeError(
                f"agent {name!r}: instructions are text or a function of the run's context,"
                f" not {instructions!r}"
            )
        self.instructions = instructions
        # Checked here: a wrong one would otherwise fail every execution of every run.
        limits = Budget.model_validate(budget) if isinstance(budget, dict) else budget
        if limits is not None and not isinstance(limits, Budget):
            raise TypeError(f"budget must be a Budget or a dict of its fields, not {budget!r}")
        self.budget: Budget = limits or Budget()
        if not isinstance(approval_ttl, timedelta):
            raise TypeError(f"approval_ttl must be a timedelta, not {approval_ttl!r}")
        if not timedelta(0) < approval_ttl <= MAX_APPROVAL_TTL:
            # timedelta.max ("never") would overflow the expiry date when a run pauses.
            raise ValueError(
                f"approval_ttl must be positive and at most {MAX_APPROVAL_TTL.days} days,"
                f" not {approval_ttl}"
            )
        self.approval_ttl = approval_ttl
        if notifier is not None and not callable(notifier):
            raise TypeError(f"agent {name!r}: notifier must be a function, not {notifier!r}")
        self.notifier = notifier
        if not (concurrency_key is None or callable(concurrency_key)) and not (
            isinstance(concurrency_key, str)
            and concurrency_key
            and is_storable_key(concurrency_key)
        ):
            raise TypeError(
                f"agent {name!r}: concurrency_key must be non-empty text, a function of the"
                f" trigger, or None, not {concurrency_key!r}"
            )
        self.concurrency_key = concurrency_key
        if state is not None and not (isinstance(state, type) and issubclass(state, BaseModel)):
            raise TypeError(f"agent {name!r}: state must be a pydantic model class, not {state!r}")
        self.state = state
        self._tools = tools
        if isinstance(tools, str | bytes) or not (callable(tools) or isinstance(tools, Iterable)):
            raise TypeError(
                f"agent {name!r}: tools are a list of tools or functions, or a function of"
                f" the run's context, not {tools!r}"
            )
        if not callable(tools):
            self._static_tools = [as_tool(t) for t in tools]
            self._check_names(self._static_tools)

    def _check_names(self, tools: list[Tool]) -> None:
        """Two tools of one name (a state tool's among them) fail every run that offers
        them: said when the agent is made, where its tools are a list."""
        names = [t.name for t in tools]
        if self.state is not None:
            names += STATE_TOOL_NAMES
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(
                f"agent {self.name!r} has two tools named {repeated[0]!r}"
                + (" (its state's tools are read_state and update_state)" if self.state else "")
            )

    def system_prompt(self, ctx: RunContext) -> str:
        if callable(self.instructions):
            return self.instructions(ctx)
        return self.instructions

    def tools_for(self, ctx: RunContext) -> list[Tool]:
        if callable(self._tools):
            return [as_tool(t) for t in self._tools(ctx)]
        return list(self._static_tools)

    def key_for(self, trigger: TriggerEnvelope) -> str | None:
        if not callable(self.concurrency_key):
            return self.concurrency_key
        key = self.concurrency_key(trigger)
        if key is None or isinstance(key, str):
            return key
        if isinstance(key, int) and not isinstance(key, bool):
            return str(key)  # an issue number, say
        raise TypeError(
            f"agent {self.name!r}: concurrency_key returned {type(key).__name__}, not str or None"
        )

    def __repr__(self) -> str:
        return f"Agent({self.name!r})"
