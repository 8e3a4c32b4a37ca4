"""One tool call: its arguments checked, its approval asked, an effect tool run at most once.

Effect tools record their intent before the call and their result after it,
keyed by (run, tool call id); a re-execution gets the recorded result back.
An intent without a result is the one case no engine can close (the process
died between the side effect and its record): ``on_unknown`` decides.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from agentruns.errors import FatalToolError
from agentruns.runs import Run
from agentruns.store.base import EffectRecord, Store
from agentruns.tools import Tool, ToolContext, ToolInputError, result_content


@dataclass(frozen=True)
class Outcome:
    """A call's result: ``content`` for the model, ``output``/``error`` for the step row."""

    content: str
    is_error: bool
    output: Any = None
    error: dict[str, str] | None = None


class EffectOutcomeUnknown(Exception):
    """An effect tool with ``on_unknown="fail"`` may or may not have run before a crash."""

    def __init__(self, tool_name: str, idempotency_key: str) -> None:
        super().__init__(
            f"{tool_name} may have run before a crash; its idempotency key is {idempotency_key}"
        )


class _Unknown(Exception):
    pass


class ToolCaller:
    """Calls the tools of one execution of one run (fenced by its epoch)."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        epoch: int,
        tools: dict[str, Tool],
        signal: threading.Event,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.epoch = epoch
        self.tools = tools
        self.signal = signal
        self.effects: dict[str, EffectRecord] = {}
        if any(t.effect for t in tools.values()):
            self.effects = store.effects(run_id)

    def call(self, call: dict[str, Any], run: Run, approved: bool) -> Outcome | None:
        """The call's outcome, or None when it must wait for a person's approval.

        Raises ``FatalToolError`` (the run fails) and ``EffectOutcomeUnknown``.
        """
        tool = self.tools.get(call["name"])
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return error("unknown_tool", f"unknown tool {call['name']!r}; available: {known}")
        try:
            arguments = tool.validate(call["input"])
        except ToolInputError as exc:
            return error("invalid_input", str(exc))
        ctx = ToolContext(
            run=run,
            tool_call_id=call["id"],
            idempotency_key=f"{run.id}:{call['id']}",
            signal=self.signal,
        )
        try:
            if not approved and tool.requires_approval(arguments, ctx):
                return None
            if tool.effect:
                return self._effect(tool, arguments, ctx, approved)
            return ok(tool(arguments, ctx))
        except FatalToolError:
            raise
        except _Unknown:
            if tool.on_unknown == "approve" and not approved:
                return None  # a person decides whether to call it again
            raise EffectOutcomeUnknown(tool.name, ctx.idempotency_key) from None
        except Exception as exc:
            return error("tool_error", f"{type(exc).__name__}: {exc}")

    def _effect(
        self, tool: Tool, arguments: dict[str, Any], ctx: ToolContext, approved: bool
    ) -> Outcome:
        record = self.effects.get(ctx.tool_call_id)
        if record is not None and record.done:
            return _recorded(record.result, record.is_error)
        if record is not None and tool.on_unknown != "retry" and not approved:
            raise _Unknown
        self.store.begin_effect(
            self.run_id, self.epoch, ctx.tool_call_id, tool.name, ctx.idempotency_key
        )
        try:
            outcome = ok(tool(arguments, ctx))
        except FatalToolError:
            raise
        except Exception as exc:
            outcome = error("tool_error", f"{type(exc).__name__}: {exc}")
        recorded = outcome.output if not outcome.is_error else outcome.content
        self.store.finish_effect(
            self.run_id, self.epoch, ctx.tool_call_id, recorded, outcome.is_error
        )
        return outcome


def ok(value: Any) -> Outcome:
    output, content = result_content(value)
    return Outcome(content=content, is_error=False, output=output)


def error(code: str, message: str) -> Outcome:
    return Outcome(content=message, is_error=True, error={"code": code, "message": message})


def _recorded(value: Any, is_error: bool) -> Outcome:
    return error("tool_error", str(value)) if is_error else ok(value)
