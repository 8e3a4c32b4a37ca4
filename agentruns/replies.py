"""Whether a model's reply can be stored and sent back to the provider, and what of
it is kept: the checks an execution makes of every reply before it is written."""

from __future__ import annotations

import dataclasses
from typing import Any

from agentruns.models.base import ModelResponse
from agentruns.runs import Usage, is_storable_key, json_problem
from agentruns.store.schema import MOST_TOKENS, STOP_REASON_LENGTH, TOOL_CALL_ID_LENGTH


def usage_of(response: ModelResponse) -> Usage | None:
    return response.usage if isinstance(response.usage, Usage) else None


def uncountable(spent: Usage, usage: Usage | None) -> str | None:
    """Why a reply's token counts cannot be added to the run's: a count below zero,
    or a total past what the store's counters hold."""
    if usage is None:
        return None
    for (kind, count), (_, total) in zip(usage, spent + usage, strict=True):
        if count < 0 or total > MOST_TOKENS:
            return f"it counts {count} {kind}"
    return None


def _blank(block: dict[str, Any]) -> bool:
    # The Messages API refuses a text block of whitespace in a request.
    return block["type"] == "text" and not block["text"].strip()


def without_blank_text(response: ModelResponse) -> ModelResponse:
    """The reply as it can be sent back to the provider: blank text blocks left out
    (a model may answer a tool call with an empty text block before it)."""
    if not any(_blank(block) for block in response.content):
        return response
    content = [block for block in response.content if not _blank(block)]
    return dataclasses.replace(response, content=content)


def malformed(response: ModelResponse) -> str | None:
    if not isinstance(response.content, list):
        return "content is not a list of blocks"
    for what, said in (("model name", response.model), ("stop_reason", response.stop_reason)):
        if isinstance(said, str) and not is_storable_key(said):
            return f"its {what} holds a NUL character or is not UTF-8: {said[:200]!r}"
    if isinstance(response.stop_reason, str) and len(response.stop_reason) > STOP_REASON_LENGTH:
        # Postgres refused its checkpoint (internal_error; SQLite kept it whole).
        return (
            f"its stop_reason is longer than {STOP_REASON_LENGTH} characters: "
            f"{response.stop_reason[:80]!r}..."
        )
    seen: set[str] = set()
    # As a trigger's payload is: no NaN (Postgres refuses it, SQLite took it), nothing
    # nested deeper than a read of its step or wait point can return. The reply is
    # checked whole (every step has one); only one that fails is searched for where.
    storable = json_problem(response.content) is None
    for block in response.content:
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            return f"not a content block: {block!r}"
        for key, value in () if storable else block.items():
            problem = json_problem(value)
            if problem is not None:
                return f"it cannot be stored (the {key} of a {block['type']} block: {problem})"
        if block["type"] == "text" and not isinstance(block.get("text"), str):
            return "a text block has no text"
        if block["type"] in _USERS_OWN:
            # The provider takes these only from the user: stored, the transcript
            # would be refused once anything followed it (a thread's next run).
            return f"a reply holds a {block['type']} block, which only a user's message may"
        if block["type"] == "tool_use":
            problem = _malformed_call(block, seen)
            if problem is not None:
                return problem
    if all(_blank(block) for block in response.content):
        # Stored, it would make the transcript one the provider refuses once anything
        # follows it (the next run of a thread, say).
        return f"the reply has no content (stop_reason={response.stop_reason})"
    if all(_blank(b) or b["type"] in _THINKING for b in response.content):
        # The run would complete with no answer as its output.
        return f"the reply holds no answer, only thinking (stop_reason={response.stop_reason})"
    return None


def with_new_ids(response: ModelResponse, earlier: set[str]) -> ModelResponse:
    """The reply, its calls that have the id of an earlier call of the transcript
    (a gateway that numbers them per reply: ``call_0``) given ids of their own. The
    provider refuses a transcript that repeats an id, and an effect tool's record is
    kept by it: such a call got the earlier call's result, and was not made."""
    if not any(call["id"] in earlier for call in response.tool_calls):
        return response
    taken = earlier | {call["id"] for call in response.tool_calls}
    content = []
    for block in response.content:
        if block.get("type") == "tool_use" and block["id"] in earlier:
            base = block["id"][: TOOL_CALL_ID_LENGTH - 12]
            n = 2
            # Only letters, digits, "_" and "-": the API's pattern for an id (and Bedrock's).
            while f"{base}-{n}" in taken:
                n += 1
            block = {**block, "id": f"{base}-{n}"}
            taken.add(block["id"])
        content.append(block)
    return dataclasses.replace(response, content=content)


def _malformed_call(block: dict[str, Any], seen: set[str]) -> str | None:
    """What is wrong with a tool_use block, given the ids of the reply's calls before it."""
    if not isinstance(block.get("id"), str) or not block["id"]:
        return "a tool_use block has no id"
    # An effect tool's record is keyed by it: every store must hold it as it is.
    if len(block["id"]) > TOOL_CALL_ID_LENGTH:
        return f"a tool_use id is longer than {TOOL_CALL_ID_LENGTH} characters"
    if not is_storable_key(block["id"]):
        return f"a tool_use id holds a NUL character or is not UTF-8: {block['id']!r}"
    if block["id"] in seen:
        return f"tool_use id {block['id']} is repeated"
    seen.add(block["id"])
    if not isinstance(block.get("name"), str) or not block["name"]:
        return "a tool_use block has no name"
    if "\x00" in block["name"]:
        return "a tool_use name holds a NUL character"
    if not isinstance(block.get("input"), dict):
        return f"the input of tool_use {block['id']} is not an object"
    return None


_THINKING = frozenset({"thinking", "redacted_thinking"})
# Content only a user's message holds (a model of one's own, or a gateway, may
# return them).
_USERS_OWN = frozenset({"tool_result", "image", "document", "search_result"})
