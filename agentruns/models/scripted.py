"""ScriptedModel: replays a fixed script with no network, for tests, the demo and benchmarks."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from agentruns.models.base import ModelAborted, ModelRequest, ModelResponse
from agentruns.runs import Usage

Block = dict[str, Any]
Response = Block | Sequence[Block] | ModelResponse
Script = Sequence[Response] | Callable[[list[dict[str, Any]]], Response]


def text(value: str) -> Block:
    """A text answer block."""
    return {"type": "text", "text": value}


def tool_use(name: str, input: dict[str, Any] | None = None, *, id: str | None = None) -> Block:
    """A tool call block; the id is filled in deterministically when omitted."""
    block: Block = {"type": "tool_use", "name": name, "input": dict(input or {})}
    if id is not None:
        block["id"] = id
    return block


class ScriptedModel:
    """Response *i* answers a transcript holding *i* assistant messages.

    So a recovered run gets the same response in any process; past the end of
    the script the last response repeats. ``calls`` holds the transcript of
    every call, for tests; ``keep_calls=False`` leaves it empty, for a model
    that serves a long-running worker (which would otherwise keep every
    transcript it was ever given, and spend its garbage collections on them).
    """

    def __init__(
        self,
        script: Script,
        *,
        usage: Usage | None = None,
        latency_s: float = 0.0,
        name: str = "scripted",
        keep_calls: bool = True,
    ) -> None:
        if not callable(script) and len(script) == 0:
            raise ValueError("ScriptedModel needs at least one response")
        self._script = script
        self._usage = usage or Usage()
        self._latency_s = latency_s
        self._name = name
        self.calls: list[list[dict[str, Any]]] = []
        self._keep_calls = keep_calls
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self._name

    def complete(self, request: ModelRequest, signal: threading.Event) -> ModelResponse:
        messages = request.messages
        if self._keep_calls:
            with self._lock:
                self.calls.append(list(messages))
        if self._latency_s and signal.wait(self._latency_s):
            raise ModelAborted("aborted")
        if signal.is_set():
            raise ModelAborted("aborted")
        turn = sum(1 for m in messages if m.get("role") == "assistant")
        if callable(self._script):
            item = self._script(messages)
        else:
            item = self._script[min(turn, len(self._script) - 1)]
        return self._response(item, turn)

    def _response(self, item: Response, turn: int) -> ModelResponse:
        if isinstance(item, ModelResponse):
            return item
        blocks = [item] if isinstance(item, dict) else list(item)
        content: list[Block] = []
        for i, block in enumerate(blocks):
            block = dict(block)
            if block.get("type") == "tool_use" and "id" not in block:
                # Deterministic ids keep a replayed script's transcript identical.
                block["id"] = f"toolu_{turn:04d}_{i:02d}"
            content.append(block)
        stop = "tool_use" if any(b.get("type") == "tool_use" for b in content) else "end_turn"
        return ModelResponse(content=content, stop_reason=stop, usage=self._usage, model=self._name)
