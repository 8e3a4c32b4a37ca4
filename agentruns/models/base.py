"""The model protocol: one call of a chat model over an Anthropic-form transcript."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from agentruns.errors import rebuilt
from agentruns.runs import Usage


class ModelError(Exception):
    """The model call failed for good (after retries); fails the run with ``model_error``.

    ``usage`` is what the provider counted for replies it sent and that were refused
    (a refusal, a cut-off tool call): the run's usage includes it."""

    def __init__(self, message: str, usage: Usage | None = None) -> None:
        super().__init__(message)
        self.usage = usage

    def __reduce__(self) -> tuple[object, ...]:
        return rebuilt, (type(self), self.args, dict(self.__dict__))  # with its usage


class ModelAborted(Exception):
    """The call was stopped because the execution's abort signal was set.

    ``usage`` is what the provider had reported for the call before it was stopped
    (its paused turns, the input of the turn it stopped, or the whole of a reply that
    arrived as it was stopped; a streamed reply's output is reported at its end): a
    cancelled, drained or timed-out run's usage includes it."""

    def __init__(self, message: str, usage: Usage | None = None) -> None:
        super().__init__(message)
        self.usage = usage

    def __reduce__(self) -> tuple[object, ...]:
        return rebuilt, (type(self), self.args, dict(self.__dict__))  # with its usage


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the model sees it (Anthropic ``tools`` entry)."""

    name: str
    description: str
    input_schema: dict[str, Any]


@dataclass(frozen=True)
class ModelRequest:
    system: str
    messages: list[dict[str, Any]]
    tools: list[ToolSpec] = field(default_factory=list)
    # The run the call is for, for a model's log lines (a retry's warning).
    run_id: str | None = None


@dataclass(frozen=True)
class ModelResponse:
    """One assistant turn in Anthropic form.

    ``content`` holds ``text`` and ``tool_use`` blocks, and any other block the
    provider returned (thinking, a server tool's), kept as it came to be sent back;
    ``stop_reason`` is the provider's (``end_turn``, ``tool_use``, ``max_tokens``, ...).
    """

    content: list[dict[str, Any]]
    stop_reason: str
    usage: Usage = field(default_factory=Usage)
    model: str = ""

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return [b for b in self.content if b.get("type") == "tool_use"]

    @property
    def text(self) -> str:
        return "".join(b.get("text", "") for b in self.content if b.get("type") == "text")


@runtime_checkable
class Model(Protocol):
    """What the engine needs from a model.

    ``complete`` must return within about 100 ms of ``signal`` being set,
    raising ``ModelAborted``; a failure that retrying won't fix raises
    ``ModelError``.
    """

    @property
    def name(self) -> str: ...

    def complete(self, request: ModelRequest, signal: threading.Event) -> ModelResponse: ...
