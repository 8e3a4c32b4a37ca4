"""Models the engine can call: the protocol, ScriptedModel, and AnthropicModel."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentruns.models.base import (
    Model,
    ModelAborted,
    ModelError,
    ModelRequest,
    ModelResponse,
    ToolSpec,
)
from agentruns.models.scripted import ScriptedModel, text, tool_use

if TYPE_CHECKING:
    from agentruns.models.anthropic import AnthropicModel

__all__ = [
    "AnthropicModel",
    "Model",
    "ModelAborted",
    "ModelError",
    "ModelRequest",
    "ModelResponse",
    "ScriptedModel",
    "ToolSpec",
    "text",
    "tool_use",
]


if not TYPE_CHECKING:
    # Hidden from type checkers, which know AnthropicModel from the import above: to
    # them a module __getattr__ would make every misspelt name here an Any.

    def __getattr__(name: str) -> Any:
        # The anthropic SDK is imported only when AnthropicModel is asked for.
        if name == "AnthropicModel":
            from agentruns.models.anthropic import AnthropicModel

            return AnthropicModel
        raise AttributeError(name)
