"""One streamed Messages API call on a helper thread that the caller can abandon
(an abort hangs up on the request), and what makes a streamed reply incomplete."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from typing import Any

import anthropic
import httpx2
from anthropic.types import Message

from agentruns.models.base import ModelAborted

log = logging.getLogger(__name__)

_POLL_S = 0.02  # how often the caller looks at the abort signal while a stream runs
# Stop reasons of a reply cut off by a limit: the model's own error says which.
CUT_OFF = frozenset({"max_tokens", "model_context_window_exceeded"})


class IncompleteStream(Exception):
    """The stream ended before ``message_stop``: the connection dropped; worth a retry."""


class NotAStream(Exception):
    """A 200 that is no event stream (a gateway that answers with the whole message as
    JSON, a proxy's page): a reply, not a dropped stream; asking again gets the same."""


class NotAMessage(Exception):
    """An event stream whose events make no Messages API message (no content list, a
    delta before its block, an event that is no JSON): asking again gets the same."""


# What the SDK's accumulation of events raises on events out of the API's order or
# shape (it trusts them: an assert, an index, a missing list).
_SHAPE_ERRORS = (AssertionError, AttributeError, IndexError, KeyError, TypeError, ValueError)


class CutInput(Exception):
    """A complete reply whose tool call input is not whole JSON (the SDK reads a cut
    one leniently, so a call could run with part of its arguments)."""

    def __init__(self, message: Message, name: str) -> None:
        super().__init__(f"the input of the model's call to {name!r} is not complete JSON")
        self.message = message


class StreamAborted(ModelAborted):
    """The stream was stopped by the abort signal; ``counted`` is the usage the
    provider had sent for it by then (the SDK's, unchecked), if any."""

    def __init__(self, message: str, counted: Any = None) -> None:
        super().__init__(message)
        self.counted = counted


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
        # The usage the provider has counted so far (message_start's, then each
        # message_delta's): what an aborted call is billed for.
        self.counted: Any = None

    def run(self, client: anthropic.Anthropic, params: dict[str, Any]) -> None:
        try:
            with client.messages.stream(**params) as stream:
                with self._lock:
                    if self._aborted:
                        return
                    self._response = stream.response
                try:
                    kind = stream.response.headers.get("content-type", "").lower()
                    if not kind.startswith("text/event-stream"):
                        raise NotAStream(
                            f"the API answered with {kind or 'no content type'}, not an event"
                            " stream (a gateway or proxy between them?)"
                        )
                    stopped = False
                    for event in stream:
                        if self._aborted:
                            return
                        stopped = stopped or event.type == "message_stop"
                        if event.type in ("message_start", "message_delta"):
                            self.counted = stream.current_message_snapshot.usage
                        if (
                            event.type == "content_block_delta"
                            and event.delta.type == "input_json_delta"
                        ):
                            self.inputs.setdefault(event.index, []).append(event.delta.partial_json)
                    if not stopped:
                        raise IncompleteStream("the response stream ended before message_stop")
                    self.message = _whole(stream.get_final_message())
                    self._check_inputs(self.message)
                except (anthropic.APIConnectionError, httpx2.TransportError) as exc:
                    # The API was reached and was answering: the stream broke off.
                    raise IncompleteStream(str(exc) or type(exc).__name__) from exc
                except _SHAPE_ERRORS as exc:
                    said = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                    raise NotAMessage(
                        f"the response stream's events do not make a message ({said})"
                    ) from exc
                finally:
                    with self._lock:
                        self._response = None
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def _check_inputs(self, message: Message) -> None:
        if message.stop_reason in CUT_OFF:
            return  # cut off by a limit: the model's own error says which (``_finish``)
        for index, parts in self.inputs.items():
            text = "".join(parts)
            block = message.content[index] if index < len(message.content) else None
            if not text.strip() or block is None or block.type != "tool_use":
                continue
            try:
                json.loads(text)
            except ValueError:
                raise CutInput(message, block.name) from None

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            if self._response is not None:
                _interrupt(self._response)


def _whole(message: Message) -> Message:
    """``message`` if it has what a reply needs; the SDK builds it unchecked."""
    blocks = message.content
    if not isinstance(blocks, list) or not all(isinstance(b.type, str) for b in blocks):
        raise NotAMessage(f"the message has no list of content blocks: content={blocks!r}")
    if message.usage is None:  # a count left out is taken for 0 (a gateway's message_start)
        raise NotAMessage("the message has no token usage")
    return message


def stream_once(
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
                raise StreamAborted("aborted during the model call")
    except BaseException as exc:
        # Aborted, or stopped where it waits (a worker's time limit, a signal): the
        # request is hung up on, not left streaming (and billed) behind it.
        attempt.abort()
        if isinstance(exc, StreamAborted):
            exc.counted = attempt.counted
        raise
    if signal.is_set():
        raise StreamAborted("aborted during the model call", attempt.counted)
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
