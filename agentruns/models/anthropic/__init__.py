"""AnthropicModel: Claude through the anthropic SDK, streamed, retried and prompt-cached."""

from __future__ import annotations

import functools
import inspect
import json
import logging
import random
import threading
from typing import Any

import anthropic
import tenacity
from anthropic.resources.messages import Messages
from anthropic.types import Message

from agentruns.errors import stops_the_task
from agentruns.models.anthropic import failures
from agentruns.models.anthropic.stream import (
    CUT_OFF,
    CutInput,
    NotAMessage,
    NotAStream,
    stream_once,
)
from agentruns.models.base import ModelAborted, ModelError, ModelRequest, ModelResponse
from agentruns.runs import Usage

log = logging.getLogger(__name__)

EPHEMERAL: dict[str, Any] = {"type": "ephemeral"}
MAX_PAUSE_TURNS = 10
MAX_CACHE_MARKS = 4  # cache_control blocks the API takes in one request
_RESERVED = frozenset({"model", "max_tokens", "messages", "system", "stream"})
_STREAM_PARAMS = frozenset(inspect.signature(Messages.stream).parameters) - {"self"}
_UNCACHEABLE = frozenset({"thinking", "redacted_thinking"})


class AnthropicModel:
    """Claude through ``anthropic.Anthropic().messages``, one streamed call per step.

    Aborts: each try streams on a helper thread while the caller watches the
    signal every 20 ms. On abort the caller raises ``ModelAborted`` at once and
    shuts the stream's socket down, so the helper's blocked read ends and the
    SDK closes the response there. (A read timeout cannot be used for polling:
    a timed-out httpx read leaves the stream unusable.) A helper still waiting
    for response headers is left to finish on its own; its result is dropped.

    Retries: 408, 409, 429, >= 500 (529 overloaded included), connection errors
    and timeouts, dropped streams and ``overloaded_error``-like SSE error events
    are retried ``max_retries`` times with exponential backoff and jitter
    (``retry-after-ms`` / ``retry-after`` win, capped at a minute); the sleep
    ends early on abort. Anything else raises ``ModelError`` at once. The SDK's
    own retries are off.

    Caching: ``cache_control`` marks the system prompt, the last block of the
    newest message and that of the previous request's newest; messages are sent
    with sorted keys so a transcript reloaded from any store yields the same prefix.

    Stop reasons: ``end_turn``, ``stop_sequence`` and ``tool_use`` are returned
    as they are; ``pause_turn`` is continued within the call (content merged,
    usage summed); ``refusal`` raises ``ModelError``. ``max_tokens`` and
    ``model_context_window_exceeded`` raise ``ModelError`` when the reply holds
    a tool call (its input may be cut off, and an unanswered ``tool_use`` must
    never reach the transcript); a text-only reply is returned with that stop
    reason, so the engine takes the truncated text as the final answer; a reply
    cut off before any text (thinking took every token) raises ``ModelError``.

    Returned content holds every block of the reply as received (the API wants
    them sent back unchanged): ``text`` (with its citations) and ``tool_use``,
    ``thinking`` and ``redacted_thinking``, and the calls and results of server
    tools, which ``tools=[...]`` adds to the agent's (``{"type":
    "web_search_20250305", "name": "web_search"}``, say).
    """

    def __init__(
        self,
        model: str,
        *,
        client: anthropic.Anthropic | None = None,
        max_tokens: int = 4096,
        max_retries: int = 4,
        retry_base_s: float = 0.5,
        retry_cap_s: float = 8.0,
        **create_kwargs: Any,
    ) -> None:
        reserved = _RESERVED & create_kwargs.keys()
        if reserved:
            raise TypeError(f"AnthropicModel sets {sorted(reserved)} itself")
        # Tools of the API's own (server tools: web search, code execution...), sent
        # after the agent's: the API runs them, and their blocks stay in the transcript.
        server_tools = create_kwargs.pop("tools", None) or []
        if not isinstance(server_tools, list | tuple) or not all(
            isinstance(t, dict) for t in server_tools
        ):
            raise TypeError("tools must be a list of tool definitions (dicts)")
        self._server_tools = [dict(t) for t in server_tools]
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self._model = model
        self._client = client.with_options(max_retries=0) if client is not None else None
        self._client_lock = threading.Lock()
        self._max_tokens = max_tokens
        self._max_retries = max_retries
        self._retry_base_s = retry_base_s
        self._retry_cap_s = retry_cap_s
        # Parameters this SDK's stream() doesn't name (e.g. temperature) go in the body as-is.
        extra = {k: v for k, v in create_kwargs.items() if k not in _STREAM_PARAMS}
        self._create_kwargs = {k: v for k, v in create_kwargs.items() if k in _STREAM_PARAMS}
        if extra:
            self._create_kwargs["extra_body"] = {**extra, **create_kwargs.get("extra_body", {})}

    @property
    def name(self) -> str:
        return self._model

    def complete(self, request: ModelRequest, signal: threading.Event) -> ModelResponse:
        if signal.is_set():
            raise ModelAborted("aborted before the model call")
        client = self._get_client()
        messages = _canonical(request.messages)
        params = self._params(request)
        # The API takes 4 cache marks in a request; the system prompt's and the tools'
        # (a server tool may carry one) come first, then the messages'.
        taken = json.dumps([params.get("system"), params.get("tools")]).count('"cache_control"')
        marks = max(0, min(2, MAX_CACHE_MARKS - taken))
        content: list[dict[str, Any]] = []
        raw: list[dict[str, Any]] = []
        usage = Usage()
        for _ in range(MAX_PAUSE_TURNS + 1):
            turn = [*messages, {"role": "assistant", "content": raw}] if raw else messages
            try:
                marked = _with_cache_marks(turn, marks)
                message = self._call(client, {**params, "messages": marked}, signal, request.run_id)
                usage = usage + _usage(message)
            except ModelError as exc:
                # The paused turns before it were answered, and counted by the provider.
                exc.usage = usage + (exc.usage or Usage())
                raise
            except ModelAborted as exc:
                # So were they, and this turn's input (or all of it, if it had ended).
                exc.usage = usage + _aborted_usage(exc)
                raise
            # Sent back in the continuation: a blank text block would be refused there.
            raw += [b for b in map(_dumped, message.content) if not _blank_text(b)]
            content += _content(message)
            if message.stop_reason != "pause_turn":
                return self._finish(message, content, usage)
        raise ModelError(
            f"the model paused its turn more than {MAX_PAUSE_TURNS} times in one call"
            " (stop_reason=pause_turn); giving up",
            usage,
        )

    # request

    def _get_client(self) -> anthropic.Anthropic:
        with self._client_lock:
            if self._client is None:
                try:
                    self._client = anthropic.Anthropic(max_retries=0)
                except anthropic.AnthropicError as exc:
                    raise ModelError(
                        f"could not create the Anthropic client ({exc}); set ANTHROPIC_API_KEY"
                    ) from exc
            return self._client

    def _params(self, request: ModelRequest) -> dict[str, Any]:
        params: dict[str, Any] = {"model": self._model, "max_tokens": self._max_tokens}
        if request.system and not request.system.isspace():  # no blank text block
            params["system"] = [
                {"type": "text", "text": request.system, "cache_control": dict(EPHEMERAL)}
            ]
        if request.tools:
            params["tools"] = [
                {
                    "name": spec.name,
                    "description": spec.description,
                    # A copy that keeps the schema's own (deterministic) property order.
                    "input_schema": json.loads(json.dumps(spec.input_schema)),
                }
                for spec in request.tools
            ]
        if self._server_tools:
            names = {t.get("name") for t in self._server_tools}
            clash = sorted(s.name for s in request.tools if s.name in names)
            if clash:
                # The API would answer 400 to every call; say which names to change.
                raise ModelError(
                    f"the agent's tool {clash[0]!r} has the name of a server tool "
                    "given to AnthropicModel(tools=...): rename one of them"
                )
            params["tools"] = [*params.get("tools", []), *self._server_tools]
        params.update(self._create_kwargs)
        return params

    # one call: tries, backoff, abort

    def _call(
        self,
        client: anthropic.Anthropic,
        params: dict[str, Any],
        signal: threading.Event,
        run_id: str | None = None,
    ) -> Message:
        def sleep(seconds: float) -> None:
            if signal.wait(seconds):
                raise ModelAborted("aborted while waiting to retry the model call")

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self._max_retries + 1),
            retry=tenacity.retry_if_exception(failures.is_transient),
            wait=self._wait,
            sleep=sleep,
            before_sleep=functools.partial(failures.log_retry, run_id=run_id),
            reraise=True,
        )
        try:
            return retrying(stream_once, client, params, signal)
        except ModelAborted:
            raise
        except CutInput as exc:
            try:
                counted: Usage | None = _usage(exc.message)
            except ModelError:
                counted = None  # what is wrong with its input is said, not its usage's
            raise ModelError(f"malformed model reply: {exc}", counted) from exc
        except (NotAStream, NotAMessage) as exc:
            raise ModelError(f"malformed model reply: {exc}") from exc
        except Exception as exc:
            if stops_the_task(exc):  # a worker's time limit: not the API's error
                raise
            tries = 1 + self._max_retries if failures.is_transient(exc) else 1
            raise ModelError(failures.describe(exc, self._model, client, tries)) from exc

    def _wait(self, state: tenacity.RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        retry_after = failures.retry_after(exc) if exc is not None else None
        if retry_after is not None and retry_after > 0:
            return min(retry_after, failures.MAX_RETRY_AFTER_S)
        # None, zero or a date gone by: the usual backoff, as the SDK's own retries do.
        delay = min(self._retry_cap_s, self._retry_base_s * 2 ** (state.attempt_number - 1))
        return random.uniform(delay / 2, delay)

    # response

    def _finish(
        self, message: Message, content: list[dict[str, Any]], usage: Usage
    ) -> ModelResponse:
        stop = message.stop_reason or "end_turn"
        if stop == "refusal":
            said = "".join(b["text"] for b in content if b["type"] == "text").strip()
            raise ModelError(
                "the model refused to answer (stop_reason=refusal)" + (f": {said}" if said else ""),
                usage,
            )
        if stop in CUT_OFF and any(b["type"] == "tool_use" for b in content):
            raise ModelError(
                f"the model's response was cut off (stop_reason={stop}) in the middle of a"
                f" tool call; raise max_tokens (now {self._max_tokens}) or shorten the transcript",
                usage,
            )
        if stop in CUT_OFF and not any(b["type"] == "text" and b["text"].strip() for b in content):
            # Thinking took every token: there is no answer to take as the run's output.
            raise ModelError(
                f"the model's response was cut off (stop_reason={stop}) before it answered;"
                f" raise max_tokens (now {self._max_tokens}) or shorten the transcript",
                usage,
            )
        return ModelResponse(content=content, stop_reason=stop, usage=usage, model=message.model)


# transcript and response shapes


def _canonical(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A deep copy with sorted keys: the same transcript always serialises the same.
    An earlier release renamed a repeated call id ``call_1~2``, which the API refuses
    (letters, digits, ``_`` and ``-``): such an id is sent as ``call_1-2``, and kept
    as it is in the transcript (an effect's record is kept by it)."""
    copied: list[dict[str, Any]] = json.loads(json.dumps(messages, sort_keys=True))
    for message in copied:
        content = message.get("content")
        for block in content if isinstance(content, list) else ():
            for field in ("id", "tool_use_id"):
                said = block.get(field) if isinstance(block, dict) else None
                if isinstance(said, str) and "~" in said:
                    block[field] = said.replace("~", "-")
    return copied


def _with_cache_marks(messages: list[dict[str, Any]], marks: int = 2) -> list[dict[str, Any]]:
    """``messages`` with ``cache_control`` on the newest message's last cacheable block,
    and on the previous request's newest (the message before the last reply), where
    that request's cache entry is: as many of the two as ``marks``, newest first. The
    API looks for an entry only about 20 blocks back from a mark: a step of many tool
    calls and results would miss it."""
    marked = list(messages)
    for index in _cache_points(messages)[:marks]:
        marked[index] = _marked(messages[index])
    return marked


def _cache_points(messages: list[dict[str, Any]]) -> list[int]:
    if not messages:
        return []
    points = [len(messages) - 1]
    replies = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if replies and replies[-1] > 0 and replies[-1] - 1 != points[0]:
        points.append(replies[-1] - 1)
    return points


def _marked(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with ``cache_control`` on its last cacheable block (if any)."""
    content = message.get("content")
    blocks: list[dict[str, Any]] = (
        [{"type": "text", "text": content}]
        if isinstance(content, str)
        else [dict(b) for b in content or []]
    )
    for block in reversed(blocks):
        empty_text = block.get("type") == "text" and not block.get("text")
        if block.get("type") not in _UNCACHEABLE and not empty_text:
            block["cache_control"] = dict(EPHEMERAL)
            return {**message, "content": blocks}
    return message


def _content(message: Message) -> list[dict[str, Any]]:
    """The reply's blocks as the API wants them sent back: every one, unchanged
    (thinking with its signature, server tools' calls and results, citations)."""
    blocks: list[dict[str, Any]] = []
    for block in message.content:
        if block.type == "tool_use":
            blocks.append(
                {"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}
            )
        else:
            blocks.append(block.model_dump(mode="json", exclude_none=True))
    return blocks


def _aborted_usage(exc: ModelAborted) -> Usage:
    """What the provider had counted for a call stopped by the abort signal."""
    counted = getattr(exc, "counted", None)
    if counted is None:
        return Usage()
    try:
        return _counts(counted)
    except ModelError:  # a count that is no count: none taken (the run is stopping)
        return Usage()


def _usage(message: Message) -> Usage:
    return _counts(message.usage)


def _counts(usage: Any) -> Usage:
    # The SDK builds the message unchecked: a count a gateway leaves out is missing,
    # and one it sends may be any JSON.
    counts: dict[str, int] = {}
    for name in Usage.model_fields:
        count = getattr(usage, name, None) or 0
        if isinstance(count, float) and count.is_integer():
            count = int(count)
        elif isinstance(count, str) and count.isascii() and count.isdigit():
            count = int(count)  # as pydantic took it before
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ModelError(f"malformed model reply: usage.{name} is {count!r}, not a count")
        counts[name] = count
    return Usage(**counts)


def _dumped(block: Any) -> dict[str, Any]:
    dumped: dict[str, Any] = block.model_dump(mode="json", exclude_none=True)
    return dumped


def _blank_text(block: dict[str, Any]) -> bool:
    """A text block of whitespace, which the API refuses in a request."""
    return block.get("type") == "text" and not str(block.get("text", "")).strip()
