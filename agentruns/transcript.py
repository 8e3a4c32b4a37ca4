"""Checks that a transcript is one the provider will accept."""

from __future__ import annotations

from typing import Any

from agentruns.errors import InvalidCheckpointError

Message = dict[str, Any]


def tool_calls(message: Message) -> list[dict[str, Any]]:
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [b for b in content if isinstance(b, dict) and b.get("type") == "tool_use"]


def text_of(message: Message) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(
        b.get("text", "") for b in content or [] if isinstance(b, dict) and b.get("type") == "text"
    )


def validate(messages: list[Message]) -> set[str]:
    """Raise ``InvalidCheckpointError`` unless the transcript can be sent to the model;
    the ids of its tool calls.

    Roles alternate from a user message; every ``tool_use`` is answered by a
    ``tool_result`` in the next message. The last message may be an assistant turn
    whose calls are still unanswered: the step in progress, or a step paused on an
    approval. (A reply's calls get ids no earlier call had: ``replies.with_new_ids``;
    a transcript an older release stored may repeat one, and is taken as it is.)
    """
    if not messages:
        raise InvalidCheckpointError("the transcript is empty")
    ids: set[str] = set()
    expected = "user"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") != expected:
            article = "an" if expected == "assistant" else "a"
            raise InvalidCheckpointError(f"message {i} should be {article} {expected} message")
        if not isinstance(message.get("content"), str | list):
            raise InvalidCheckpointError(f"message {i} has no content")
        if expected == "assistant":
            _check_calls(message, i, ids)
            calls = tool_calls(message)
            if calls and i + 1 < len(messages):
                check_answered(calls, messages[i + 1], i + 1)
        expected = "assistant" if expected == "user" else "user"
    return ids


def _check_calls(message: Message, index: int, ids: set[str]) -> None:
    content = message["content"]
    for block in content if isinstance(content, list) else []:
        if isinstance(block, dict) and block.get("type") == "tool_use":
            fine = isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
            if not (fine and isinstance(block.get("input"), dict)):
                raise InvalidCheckpointError(
                    f"message {index} has a tool_use block without an id, name or input"
                )
            ids.add(block["id"])


def check_answered(calls: list[dict[str, Any]], answer: Message, index: int) -> None:
    content = answer.get("content") if isinstance(answer, dict) else None  # edited by hand
    blocks = content if isinstance(content, list) else []
    answered = {
        b.get("tool_use_id")
        for b in blocks
        if isinstance(b, dict) and b.get("type") == "tool_result"
    }
    missing = [c.get("id") for c in calls if c.get("id") not in answered]
    if missing:
        raise InvalidCheckpointError(f"message {index} does not answer tool calls {missing}")


def results_message(results: list[dict[str, Any]]) -> Message:
    return {"role": "user", "content": results}


def tool_result(tool_use_id: str, content: str, is_error: bool) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": tool_use_id, "content": content}
    if is_error:
        block["is_error"] = True
    return block
