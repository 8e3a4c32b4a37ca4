"""One tool call: its arguments checked, its approval asked, an effect tool run at most once.

Effect tools record their intent before the call and their result after it,
keyed by (run, tool call id); a re-execution gets the recorded result back.
An intent without a result is the one case no engine can close (the process
died between the side effect and its record): ``on_unknown`` decides.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentruns.errors import (
    FatalToolError,
    LeaseLostError,
    exception_text,
    first_line,
    stops_the_task,
)
from agentruns.runs import Run, storable_text
from agentruns.store.base import EffectRecord, Store
from agentruns.store.connect import dumps
from agentruns.tools import Tool, ToolContext, ToolInputError, result_content

log = logging.getLogger("agentruns")


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


@dataclass(frozen=True)
class Wait:
    """The call waits for a person: to be made at all, or (``unknown``) to be made
    again after a crash left the outcome of its first attempt unknown."""

    unknown: bool = False


class ToolCaller:
    """Calls the tools of one execution of one run (fenced by its epoch)."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        epoch: int,
        tools: dict[str, Tool],
        signal: threading.Event,
        holds_lease: Callable[[], bool] = lambda: True,
    ) -> None:
        self.store = store
        # Asked right before a tool is called: a process stopped past its lease goes
        # on where it stopped, and must not make a call another process made since.
        self.holds_lease = holds_lease
        self.run_id = run_id
        self.epoch = epoch
        self.tools = tools
        self.signal = signal
        self.effects: dict[str, EffectRecord] = {}
        if any(t.effect for t in tools.values()):
            self.effects = store.effects(run_id)

    def call(
        self, call: dict[str, Any], run: Run, approved: bool, again: bool = False
    ) -> Outcome | Wait:
        """The call's outcome, or a ``Wait`` for a person's approval.

        ``approved``: a person approved the call; ``again``: they approved calling it
        again although its first attempt may have happened. Only what the tool
        raises becomes a tool error: a failure to record an effect propagates, as
        any failed write does. Raises ``FatalToolError`` (the run fails) and
        ``EffectOutcomeUnknown``.
        """
        tool = self.tools.get(call["name"])
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return error("unknown_tool", f"unknown tool {call['name']!r}; available: {known}")
        given = call["input"]
        try:
            if isinstance(given, dict) and any(isinstance(v, dict | list) for v in given.values()):
                # The tool gets its own copy: what it does to it must not change the
                # call as the transcript, its step row and the model's next request
                # hold it. (Through JSON, which it was stored as: deepcopy recurses
                # in Python, and gives up at a depth the store takes.)
                given = json.loads(dumps(given))
            arguments = tool.validate(given)
        except ToolInputError as exc:
            return error("invalid_input", str(exc))
        except RecursionError:
            return error("invalid_input", f"the input of {tool.name} is nested too deep")
        ctx = ToolContext(
            run=run,
            tool_call_id=call["id"],
            idempotency_key=f"{run.id}:{call['id']}",
            signal=self.signal,
        )
        try:
            if not approved and tool.requires_approval(arguments, ctx):
                return Wait()
        except FatalToolError:
            raise
        except BaseException as exc:
            return _raised_by_tool_code(exc)
        if tool.effect:
            return self._effect(tool, arguments, ctx, again)
        self._check_lease()
        return _invoke(tool, arguments, ctx)

    def _effect(
        self, tool: Tool, arguments: dict[str, Any], ctx: ToolContext, again: bool
    ) -> Outcome | Wait:
        record = self.effects.get(ctx.tool_call_id)
        if record is not None and not record.done:
            # Read again: an execution that lost the run while the call ran records its
            # result when its worker goes on (one paused past its lease, say), or, if
            # its call said it failed (FatalToolError), deletes its intent: none left,
            # the call is made as a first one, not taken for one of unknown outcome.
            record = self.store.effects(self.run_id).get(ctx.tool_call_id)
        if record is not None and record.done:
            return _recorded(record.result, record.is_error)
        # An intent without a result: the call may have happened. An approval of the
        # call itself does not cover that (it was given before the first attempt).
        if record is not None and tool.on_unknown != "retry" and not again:
            if tool.on_unknown == "approve":
                return Wait(unknown=True)
            raise EffectOutcomeUnknown(tool.name, ctx.idempotency_key)
        if record is not None:
            # The one event an operator most needs to hear of: a side effect that may
            # now happen twice, unless the far side deduplicates by the key.
            log.warning(
                "run %s calls effect tool %s again (idempotency key %s): the outcome of its"
                " first attempt is unknown (its worker died, or lost the run, during the call)",
                self.run_id,
                tool.name,
                ctx.idempotency_key,
            )
        begun = self.store.begin_effect(
            self.run_id, self.epoch, ctx.tool_call_id, tool.name, ctx.idempotency_key
        )
        if begun.done:  # recorded since it was read, by an execution that lost the run
            return _recorded(begun.result, begun.is_error)
        self._check_lease()
        try:
            outcome = _invoke(tool, arguments, ctx)
        except FatalToolError:
            # An earlier attempt's intent this one took over goes back to it: this one's
            # failure does not tell its outcome, so a retry takes it for unknown again
            # (a person who approved this attempt approved it, not the next).
            self._forget(begun)
            raise
        recorded = outcome.output if not outcome.is_error else outcome.content
        if self.store.finish_effect(self.run_id, self.epoch, begun, recorded, outcome.is_error):
            return outcome
        # An error, not recorded over the success an earlier attempt recorded meanwhile
        # (its worker paused past its lease): the call happened, and that is its outcome.
        kept = self.store.effects(self.run_id)[ctx.tool_call_id]
        return _recorded(kept.result, kept.is_error)

    def _check_lease(self) -> None:
        if not self.holds_lease():
            raise LeaseLostError(self.run_id)

    def _forget(self, begun: EffectRecord) -> None:
        """The tool said its call failed (``FatalToolError``): no outcome to keep, so a
        retry of the run calls it again, unless the outcome of an earlier attempt it
        took over is unknown (``Effects.forget``). If the intent cannot be deleted (an
        outage), it stays, and a retry takes the call's outcome for unknown."""
        try:
            self.store.forget_effect(self.run_id, begun)
        except Exception as exc:
            log.warning(
                "run %s: could not delete the intent of effect call %s that raised"
                " FatalToolError (%s): a retry takes its outcome for unknown",
                self.run_id,
                begun.tool_call_id,
                first_line(exc),
            )


def _invoke(tool: Tool, arguments: dict[str, Any], ctx: ToolContext) -> Outcome:
    """The tool's own outcome: what it raises (but ``FatalToolError``) is a tool error."""
    try:
        return ok(tool(arguments, ctx))
    except FatalToolError:
        raise
    except BaseException as exc:
        return _raised_by_tool_code(exc)


def _raised_by_tool_code(exc: BaseException) -> Outcome:
    """What a tool's code (the tool, its ``needs_approval`` callable) raised, as the
    call's tool error; asyncio.CancelledError too. What stops the task (a worker's
    time limit, a signal: ``stops_the_task``) is raised on: the run is left for
    recovery, as after a crash, and an effect's record stays unfinished (its side
    effect may have happened). Anything else raised on (``SystemExit`` from
    argparse, in a pool's thread) would end the thread's task unfinished."""
    if stops_the_task(exc):
        raise exc
    return error("tool_error", exception_text(exc))


def ok(value: Any) -> Outcome:
    output, content = result_content(value)
    return Outcome(content=content, is_error=False, output=output)


def error(code: str, message: str) -> Outcome:
    message = storable_text(message)  # it may quote undecodable bytes (a file name)
    return Outcome(content=message, is_error=True, error={"code": code, "message": message})


def _recorded(value: Any, is_error: bool) -> Outcome:
    return error("tool_error", str(value)) if is_error else ok(value)
