"""AnthropicModel: Claude through the anthropic SDK, streamed, retried and prompt-cached."""

from __future__ import annotations

import contextlib
import email.utils
import inspect
import json
import logging
import random
import socket
import threading
import time
import urllib.parse
from typing import Any

import anthropic
import httpx2
import tenacity
from anthropic.resources.messages import Messages
from anthropic.types import Message

from agentruns.errors import stops_the_task
from agentruns.models.base import ModelAborted, ModelError, ModelRequest, ModelResponse
from agentruns.runs import Usage

log = logging.getLogger(__name__)

EPHEMERAL: dict[str, Any] = {"type": "ephemeral"}
MAX_RETRY_AFTER_S = 60.0  # a longer retry-after is waited out only this long per try
MAX_PAUSE_TURNS = 10
MAX_CACHE_MARKS = 4  # cache_control blocks the API takes in one request
_POLL_S = 0.02  # how often the caller looks at the abort signal while a stream runs
_TRANSIENT_STATUS = frozenset({408, 409, 429})
_TRANSIENT_STREAM_ERRORS = frozenset(
    {"overloaded_error", "api_error", "rate_limit_error", "timeout_error"}
)
_RESERVED = frozenset({"model", "max_tokens", "messages", "system", "stream"})
_STREAM_PARAMS = frozenset(inspect.signature(Messages.stream).parameters) - {"self"}
_UNCACHEABLE = frozenset({"thinking", "redacted_thinking"})
_CUT_OFF = frozenset({"max_tokens", "model_context_window_exceeded"})


class _IncompleteStream(Exception):
    """The stream ended before ``message_stop``: the connection dropped; worth a retry."""


class _CutInput(Exception):
    """A complete reply whose tool call input is not whole JSON (the SDK reads a cut
    one leniently, so a call could run with part of its arguments)."""

    def __init__(self, message: Message, name: str) -> None:
        super().__init__(f"the input of the model's call to {name!r} is not complete JSON")
        self.message = message


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
                message = self._call(client, {**params, "messages": marked}, signal)
            except ModelError as exc:
                # The paused turns before it were answered, and counted by the provider.
                exc.usage = usage + (exc.usage or Usage())
                raise
            usage = usage + _usage(message)
            raw += [block.model_dump(mode="json", exclude_none=True) for block in message.content]
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
        if request.system:
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
        self, client: anthropic.Anthropic, params: dict[str, Any], signal: threading.Event
    ) -> Message:
        def sleep(seconds: float) -> None:
            if signal.wait(seconds):
                raise ModelAborted("aborted while waiting to retry the model call")

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self._max_retries + 1),
            retry=tenacity.retry_if_exception(_is_transient),
            wait=self._wait,
            sleep=sleep,
            before_sleep=_log_retry,
            reraise=True,
        )
        try:
            return retrying(_stream_once, client, params, signal)
        except ModelAborted:
            raise
        except _CutInput as exc:
            raise ModelError(f"malformed model reply: {exc}", _usage(exc.message)) from exc
        except Exception as exc:
            if stops_the_task(exc):  # a worker's time limit: not the API's error
                raise
            tries = 1 + self._max_retries if _is_transient(exc) else 1
            raise ModelError(_describe(exc, self._model, client, tries)) from exc

    def _wait(self, state: tenacity.RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        retry_after = _retry_after(exc) if exc is not None else None
        if retry_after is not None and retry_after > 0:
            return min(retry_after, MAX_RETRY_AFTER_S)
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
        if stop in _CUT_OFF and any(b["type"] == "tool_use" for b in content):
            raise ModelError(
                f"the model's response was cut off (stop_reason={stop}) in the middle of a"
                f" tool call; raise max_tokens (now {self._max_tokens}) or shorten the transcript",
                usage,
            )
        if stop in _CUT_OFF and not any(b["type"] == "text" and b["text"].strip() for b in content):
            # Thinking took every token: there is no answer to take as the run's output.
            raise ModelError(
                f"the model's response was cut off (stop_reason={stop}) before it answered;"
                f" raise max_tokens (now {self._max_tokens}) or shorten the transcript",
                usage,
            )
        return ModelResponse(content=content, stop_reason=stop, usage=usage, model=message.model)


class _Stream:
    """One streamed request on a helper thread that the caller can abandon."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.message: Message | None = None
        self.error: BaseException | None = None
        self.inputs: dict[int, list[str]] = {}  # each tool call's input JSON, as sent
        self._lock = threading.Lock()
        self._response: httpx2.Response | None = None
        self._aborted = False

    def run(self, client: anthropic.Anthropic, params: dict[str, Any]) -> None:
        try:
            with client.messages.stream(**params) as stream:
                with self._lock:
                    if self._aborted:
                        return
                    self._response = stream.response
                try:
                    stopped = False
                    for event in stream:
                        if self._aborted:
                            return
                        stopped = stopped or event.type == "message_stop"
                        if (
                            event.type == "content_block_delta"
                            and event.delta.type == "input_json_delta"
                        ):
                            self.inputs.setdefault(event.index, []).append(event.delta.partial_json)
                    if not stopped:
                        raise _IncompleteStream("the response stream ended before message_stop")
                    self.message = stream.get_final_message()
                    self._check_inputs(self.message)
                except (anthropic.APIConnectionError, httpx2.TransportError) as exc:
                    # The API was reached and was answering: the stream broke off.
                    raise _IncompleteStream(str(exc) or type(exc).__name__) from exc
                finally:
                    with self._lock:
                        self._response = None
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def _check_inputs(self, message: Message) -> None:
        if message.stop_reason in _CUT_OFF:
            return  # cut off by a limit: the model's own error says which (``_finish``)
        for index, parts in self.inputs.items():
            text = "".join(parts)
            block = message.content[index] if index < len(message.content) else None
            if not text.strip() or block is None or block.type != "tool_use":
                continue
            try:
                json.loads(text)
            except ValueError:
                raise _CutInput(message, block.name) from None

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            if self._response is not None:
                _interrupt(self._response)


def _stream_once(
    client: anthropic.Anthropic, params: dict[str, Any], signal: threading.Event
) -> Message:
    if signal.is_set():
        raise ModelAborted("aborted before the model call")
    attempt = _Stream()
    helper = threading.Thread(
        target=attempt.run, args=(client, params), name="anthropic-stream", daemon=True
    )
    helper.start()
    try:
        while not attempt.done.wait(_POLL_S):
            if signal.is_set():
                raise ModelAborted("aborted during the model call")
    except BaseException:
        # Aborted, or stopped where it waits (a worker's time limit, a signal): the
        # request is hung up on, not left streaming (and billed) behind it.
        attempt.abort()
        raise
    if signal.is_set():
        raise ModelAborted("aborted during the model call")
    if attempt.error is not None:
        raise attempt.error
    assert attempt.message is not None
    return attempt.message


def _interrupt(response: httpx2.Response) -> None:
    """Make a read blocked on ``response`` return now, from another thread."""
    network = response.extensions.get("network_stream")
    sock = network.get_extra_info("socket") if network is not None else None
    if isinstance(sock, socket.socket):
        # The base method on purpose: SSLSocket.shutdown also drops its SSL object.
        with contextlib.suppress(OSError):  # already closed
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        return
    try:
        response.close()
    except Exception:  # the reader may be closing it at the same moment
        log.debug("closing an aborted stream failed", exc_info=True)


# classification and messages


def _is_transient(exc: BaseException) -> bool:
    """Whether the SDK would retry this (its retries are off: ours keep its policy),
    or it is a stream cut short. As the SDK does, the ``__cause__`` chain counts
    (a middleware's error raised from a retryable one), and so does the server's
    ``x-should-retry`` header."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, _RETRYABLE):
            return True
        if isinstance(current, anthropic.APIStatusError):
            if current.status_code < 400:  # an error event inside a 200 stream
                return current.type in _TRANSIENT_STREAM_ERRORS
            said = current.response.headers.get("x-should-retry")
            if said in ("true", "false"):
                return said == "true"
            return current.status_code in _TRANSIENT_STATUS or current.status_code >= 500
        if isinstance(current, anthropic.APIConnectionError | httpx2.TransportError):
            return True
        current = current.__cause__
    return False


# What a client's middleware raises to ask for a retry, and a stream cut short.
_RETRYABLE = (anthropic.RetryableError, _IncompleteStream)


def _retry_after(exc: BaseException) -> float | None:
    if not isinstance(exc, anthropic.APIStatusError) or exc.status_code < 400:
        return None
    headers = exc.response.headers
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return float(value) * scale
        except ValueError:
            pass
        if name == "retry-after" and (date := email.utils.parsedate_tz(value)) is not None:
            return float(email.utils.mktime_tz(date)) - time.time()
    return None


def _log_retry(state: tenacity.RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    wait = state.next_action.sleep if state.next_action is not None else 0.0
    log.warning(
        "Anthropic call failed (try %d): %s; retrying in %.2fs", state.attempt_number, exc, wait
    )


def _describe(exc: BaseException, model: str, client: anthropic.Anthropic, tries: int) -> str:
    after = f" after {tries} tries" if tries > 1 else ""
    if isinstance(exc, anthropic.APIStatusError):
        detail = exc.api_message or str(exc)
        where = "in the response stream" if exc.status_code < 400 else f"HTTP {exc.status_code}"
        hint = {
            401: "; check ANTHROPIC_API_KEY",
            403: "; the API key may not have access to this model or feature",
            404: f"; check the model id {model!r}",
            413: "; the request is too large, shorten the transcript or tool results",
        }.get(exc.status_code, "")
        return f"Anthropic API error{after}: {exc.type or 'error'} ({where}): {detail}{hint}"
    if isinstance(exc, anthropic.APITimeoutError):
        return f"the Anthropic API at {_shown(client.base_url)} timed out{after}"
    if isinstance(exc, anthropic.APIConnectionError | httpx2.TransportError):
        return f"could not reach the Anthropic API at {_shown(client.base_url)}{after}: {exc}"
    if isinstance(exc, _IncompleteStream):
        return f"the Anthropic response stream was cut off{after}: {exc}"
    hint = "; set ANTHROPIC_API_KEY" if "authentication" in str(exc).lower() else ""
    return f"the Anthropic call failed: {type(exc).__name__}: {exc}{hint}"


def _shown(url: Any) -> str:
    """A base URL fit for an error message (stored with the run): no user, password
    or query, where a gateway may keep its credentials."""
    parts = urllib.parse.urlsplit(str(url))
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


# transcript and response shapes


def _canonical(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A deep copy with sorted keys: the same transcript always serialises the same."""
    copied: list[dict[str, Any]] = json.loads(json.dumps(messages, sort_keys=True))
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


def _usage(message: Message) -> Usage:
    u = message.usage
    return Usage(
        input_tokens=u.input_tokens or 0,
        output_tokens=u.output_tokens or 0,
        cache_creation_input_tokens=u.cache_creation_input_tokens or 0,
        cache_read_input_tokens=u.cache_read_input_tokens or 0,
    )
