"""A local HTTP server that speaks enough of Anthropic's Messages API for tests.

There is no network in tests, so the real ``anthropic`` SDK is pointed at this
server instead. It answers ``POST /v1/messages`` with SSE streams (when the body
has ``"stream": true``, as ``client.messages.stream`` sends) or JSON messages,
with Anthropic-shaped error bodies, and records every request.

Script it with planned replies, served in order::

    from tests.fake_anthropic import FakeAnthropic, error, reply, slow, text, tool_use, usage

    with FakeAnthropic() as fake:
        fake.push(
            error(529),                                        # overloaded_error
            error(429, retry_after_ms=50),                     # rate limit, retry-after-ms
            reply(tool_use("search", {"q": "crash"}, id="toolu_1"), usage=usage(12, 3)),
            slow(5.0, reply(text("late"))),                    # message_start, then stalls
            reply(text("Done."), usage=usage(20, 4, cache_read=10)),
        )
        client = fake.client()        # anthropic.Anthropic(api_key="test", base_url=fake.url)
        ...
        fake.requests[0].body["system"]          # parsed JSON of each request
        fake.requests[0].api_key                 # x-api-key or bearer token
        fake.requests[0].headers                 # lower-cased header names

A request the real API would refuse gets its 400 ``invalid_request_error``, as
the API words it, without taking a planned reply: a tool_use id other than
letters, digits, ``_`` and ``-``; a text block that is blank; a tool_result
that answers no tool_use of the assistant turn before it, or a tool_use whose
result is not in the next message (``fake.refused`` lists what was refused).

When the queue is empty, ``fake.responder`` (a callable taking the
``RecordedRequest`` and returning a reply) answers, so an engine test can reply
according to the transcript; with neither, the server answers 400
``invalid_request_error`` "no reply scripted", which fails a call at once.

A ``reply`` without ``stop_reason`` gets ``tool_use`` when it holds a tool call
and ``end_turn`` otherwise. ``reply(..., stream_error="overloaded_error")`` sends
``message_start`` and then an SSE ``error`` event, as the API does when it
overloads mid-stream; ``dropped()`` hangs up right after ``message_start``. A
tool_use block with a ``partial_json`` string streams that raw (possibly cut-off)
JSON instead of its ``input``. ``slow()`` replies set ``request.stalled`` when
they start stalling and ``request.disconnected`` when the client hangs up.

Connections are kept alive like the real API. ``close()`` (or leaving the
``with`` block) stops the server, wakes stalled replies and closes idle
connections, then joins every handler thread.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import select
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

import anthropic

Block = dict[str, Any]

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "api_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "api_error",
    529: "overloaded_error",
}


# --- scripting -------------------------------------------------------------


def text(value: str) -> Block:
    """A text content block."""
    return {"type": "text", "text": value}


def tool_use(
    name: str,
    input: dict[str, Any] | None = None,
    *,
    id: str | None = None,
    partial_json: str | None = None,
) -> Block:
    """A tool_use block; ``partial_json`` streams that raw text instead of ``input``."""
    block: Block = {"type": "tool_use", "name": name, "input": dict(input or {})}
    if id is not None:
        block["id"] = id
    if partial_json is not None:
        block["partial_json"] = partial_json
    return block


def thinking(value: str, signature: str = "sig") -> Block:
    """An extended-thinking block."""
    return {"type": "thinking", "thinking": value, "signature": signature}


def usage(
    input_tokens: int = 10,
    output_tokens: int = 5,
    *,
    cache_creation: int = 0,
    cache_read: int = 0,
) -> dict[str, int]:
    """Usage numbers for a reply, as the API reports them."""
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": cache_creation,
        "cache_read_input_tokens": cache_read,
    }


@dataclass
class Reply:
    """A successful message: its blocks, stop reason and usage; optionally slow or failing."""

    content: list[Block]
    stop_reason: str | None = None
    usage: dict[str, int] = field(default_factory=usage)
    model: str | None = None
    stall_s: float = 0.0  # after message_start, wait this long before the rest
    stream_error: str | None = None  # an SSE error event of this type after message_start
    drop: bool = False  # hang up right after message_start, mid-body
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class ErrorReply:
    """An HTTP error with an Anthropic error body."""

    status: int
    type: str
    message: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class RawReply:
    """A 200 that is no event stream: a gateway's whole JSON message, a proxy's page."""

    content_type: str
    body: bytes


AnyReply = Reply | ErrorReply | RawReply


def reply(
    *blocks: Block,
    stop_reason: str | None = None,
    usage: dict[str, int] | None = None,
    model: str | None = None,
    stream_error: str | None = None,
) -> Reply:
    """A message holding ``blocks``; the stop reason is inferred when omitted."""
    return Reply(
        content=[dict(b) for b in blocks],
        stop_reason=stop_reason,
        usage=usage if usage is not None else _default_usage(),
        model=model,
        stream_error=stream_error,
    )


def _default_usage() -> dict[str, int]:
    return usage()


def slow(stall_s: float, then: Reply | None = None) -> Reply:
    """``then`` (default: a short text answer), stalling ``stall_s`` after message_start."""
    base = then if then is not None else reply(text("slow answer"))
    base.stall_s = stall_s
    return base


def dropped() -> Reply:
    """A stream whose connection is cut right after message_start."""
    base = reply(text("never finished"))
    base.drop = True
    return base


def unstreamed(then: Reply | None = None) -> RawReply:
    """``then`` (default: a short text answer) as one JSON message, though a stream was
    asked for (a gateway that does not stream)."""
    base = then if then is not None else reply(text("whole answer"))
    body = {
        "id": "msg_unstreamed",
        "type": "message",
        "role": "assistant",
        "model": base.model or "claude-test",
        "content": base.content,
        "stop_reason": base.stop_reason or "end_turn",
        "stop_sequence": None,
        "usage": base.usage,
    }
    return RawReply("application/json", json.dumps(body).encode())


def events(*sent: dict[str, Any] | str) -> RawReply:
    """A stream of exactly these events (a dict is sent as its JSON, a string as is),
    for events out of the API's order or shape."""
    body = "".join(
        f"event: {e['type']}\ndata: {json.dumps(e)}\n\n"
        if isinstance(e, dict)
        else f"event: message_start\ndata: {e}\n\n"
        for e in sent
    )
    return RawReply("text/event-stream", body.encode())


def error(
    status: int,
    type: str | None = None,
    message: str | None = None,
    *,
    retry_after: float | None = None,
    retry_after_ms: float | None = None,
    headers: dict[str, str] | None = None,
) -> ErrorReply:
    """An error reply; the error type follows the status as the API's does."""
    kind = type or _ERROR_TYPES.get(status, "api_error")
    all_headers = dict(headers or {})
    if retry_after is not None:
        all_headers["retry-after"] = _number(retry_after)
    if retry_after_ms is not None:
        all_headers["retry-after-ms"] = _number(retry_after_ms)
    return ErrorReply(status, kind, message or f"fake {kind}", all_headers)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


# --- the server ------------------------------------------------------------


@dataclass
class RecordedRequest:
    """One request as the server saw it."""

    method: str
    path: str
    headers: dict[str, str]
    raw: bytes
    body: Any
    at: float  # time.monotonic() on arrival
    stalled: threading.Event = field(default_factory=threading.Event)
    disconnected: threading.Event = field(default_factory=threading.Event)

    @property
    def api_key(self) -> str | None:
        """The key the client sent, as ``x-api-key`` or a bearer token (SDKs differ)."""
        if "x-api-key" in self.headers:
            return self.headers["x-api-key"]
        scheme, _, token = self.headers.get("authorization", "").partition(" ")
        return token if scheme.lower() == "bearer" else None

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.body.get("messages", [])) if isinstance(self.body, dict) else []


class FakeAnthropic:
    """A threaded Messages API server on 127.0.0.1 with scripted replies."""

    def __init__(
        self,
        replies: list[AnyReply] | None = None,
        *,
        responder: Callable[[RecordedRequest], AnyReply] | None = None,
        model: str = "claude-fake-1",
    ) -> None:
        self.responder = responder
        self.model = model
        self.requests: list[RecordedRequest] = []
        self.refused: list[str] = []  # what requests the API would refuse said
        self._queue: deque[AnyReply] = deque(replies or [])
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._closing = threading.Event()
        self._connections: set[socket.socket] = set()
        self._ids = itertools.count(1)
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.fake = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        host, port = self._server.server_address[:2]
        self.url = f"http://{host!s}:{port}"

    # scripting

    def push(self, *replies: AnyReply) -> None:
        """Queue replies, served in order before ``responder`` is asked."""
        with self._lock:
            self._queue.extend(replies)

    def client(self, **kwargs: Any) -> anthropic.Anthropic:
        """A real SDK client aimed at this server."""
        kwargs.setdefault("api_key", "test")
        return anthropic.Anthropic(base_url=self.url, **kwargs)

    def wait_for_requests(self, count: int, timeout: float = 5.0) -> list[RecordedRequest]:
        """Block until ``count`` requests have arrived; raises TimeoutError otherwise."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: len(self.requests) >= count, timeout):
                raise TimeoutError(f"{len(self.requests)} of {count} requests arrived")
            return list(self.requests)

    @property
    def pending(self) -> int:
        """Replies queued and not yet served."""
        with self._lock:
            return len(self._queue)

    # lifecycle

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        self._server.shutdown()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            # Wakes handler threads waiting on a kept-alive connection.
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._server.server_close()  # joins the handler threads
        self._thread.join(timeout=5)

    def __enter__(self) -> FakeAnthropic:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # used by the handler

    def _record(self, request: RecordedRequest) -> AnyReply:
        with self._arrived:
            self.requests.append(request)
            self._arrived.notify_all()
            if (problem := refusal(request.messages)) is not None:
                self.refused.append(problem)
                return error(400, message=problem)
            planned = self._queue.popleft() if self._queue else None
        if planned is None and self.responder is not None:
            planned = self.responder(request)
        if planned is None:
            return error(400, message="fake Anthropic server: no reply scripted for this request")
        return planned

    def _track(self, conn: socket.socket, *, open: bool) -> None:
        with self._lock:
            if open:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # so server_close() joins the handlers
    block_on_close = True
    fake: FakeAnthropic

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client hanging up mid-request is what abort tests do on purpose.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.fake._track(self.connection, open=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.fake._track(self.connection, open=False)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output quiet

    def do_GET(self) -> None:
        self._send_error(error(404, message=f"no route {self.path}"))

    def do_POST(self) -> None:
        fake = self.server.fake
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = None
        request = RecordedRequest(
            method="POST",
            path=self.path,
            headers={k.lower(): v for k, v in self.headers.items()},
            raw=raw,
            body=body,
            at=time.monotonic(),
        )
        if self.path.split("?")[0] != "/v1/messages":
            fake._record(request)
            self._send_error(error(404, message=f"no route {self.path}"))
            return
        planned = fake._record(request)
        try:
            if isinstance(planned, ErrorReply):
                self._send_error(planned)
            elif isinstance(planned, RawReply):
                self._send_raw(planned)
            elif isinstance(body, dict) and body.get("stream"):
                self._send_stream(planned, request)
            else:
                self._send_json(200, _message(planned, request, fake, next(fake._ids)))
        except (BrokenPipeError, ConnectionResetError):
            request.disconnected.set()
            self.close_connection = True

    # responses

    def _send_json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.send_header("request-id", f"req_fake_{status}")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _send_raw(self, planned: RawReply) -> None:
        self.send_response(200)
        self.send_header("content-type", planned.content_type)
        self.send_header("content-length", str(len(planned.body)))
        self.end_headers()
        self.wfile.write(planned.body)
        self.wfile.flush()

    def _send_error(self, planned: ErrorReply) -> None:
        body = {"type": "error", "error": {"type": planned.type, "message": planned.message}}
        self._send_json(planned.status, body, planned.headers)

    def _send_stream(self, planned: Reply, request: RecordedRequest) -> None:
        fake = self.server.fake
        message = _message(planned, request, fake, next(fake._ids))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("transfer-encoding", "chunked")
        self.send_header("request-id", "req_fake_stream")
        for name, value in planned.headers.items():
            self.send_header(name, value)
        self.end_headers()

        start = dict(message, content=[], stop_reason=None, stop_sequence=None)
        start["usage"] = dict(message["usage"], output_tokens=1)
        self._event("message_start", {"type": "message_start", "message": start})
        if planned.stall_s:
            request.stalled.set()
            if not self._stall(planned.stall_s, request):
                return
        if planned.drop:
            self.close_connection = True
            return
        if planned.stream_error:
            self._event(
                "error",
                {
                    "type": "error",
                    "error": {"type": planned.stream_error, "message": "fake mid-stream error"},
                },
            )
            self._end_chunks()
            return
        self._event("ping", {"type": "ping"})
        for index, block in enumerate(message["content"]):
            self._stream_block(index, block, planned.content[index])
        self._event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                "usage": {"output_tokens": message["usage"]["output_tokens"]},
            },
        )
        self._event("message_stop", {"type": "message_stop"})
        self._end_chunks()

    def _stream_block(self, index: int, block: Block, planned: Block) -> None:
        kind = block["type"]
        if kind == "text":
            start: Block = {"type": "text", "text": ""}
        elif kind == "tool_use":
            start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
        elif kind == "thinking":
            start = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            start = block
        self._event(
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": start},
        )
        deltas: list[Block] = []
        if kind == "text":
            deltas = [{"type": "text_delta", "text": c} for c in _chunks(block["text"])]
            deltas += [
                {"type": "citations_delta", "citation": c} for c in block.get("citations", [])
            ]
        elif kind == "tool_use":
            raw = planned.get("partial_json")
            if raw is None:
                raw = json.dumps(block["input"]) if block["input"] else ""
            deltas = [{"type": "input_json_delta", "partial_json": c} for c in _chunks(raw)]
        elif kind == "thinking":
            deltas = [{"type": "thinking_delta", "thinking": c} for c in _chunks(block["thinking"])]
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
        for delta in deltas:
            self._event(
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": delta},
            )
        self._event("content_block_stop", {"type": "content_block_stop", "index": index})

    def _event(self, name: str, data: Any) -> None:
        self._chunk(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _end_chunks(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _stall(self, seconds: float, request: RecordedRequest) -> bool:
        """Wait, noticing the client hanging up; False when the reply should stop."""
        deadline = time.monotonic() + seconds
        fake = self.server.fake
        while (left := deadline - time.monotonic()) > 0:
            if fake._closing.is_set():
                self.close_connection = True
                return False
            readable, _, _ = select.select([self.connection], [], [], min(left, 0.02))
            if readable:
                try:
                    gone = self.connection.recv(1, socket.MSG_PEEK) == b""
                except OSError:
                    gone = True
                if gone:
                    request.disconnected.set()
                    self.close_connection = True
                    return False
        return True


def _message(planned: Reply, request: RecordedRequest, fake: FakeAnthropic, n: int) -> Block:
    """The full Message object a reply stands for."""
    content: list[Block] = []
    for i, block in enumerate(planned.content):
        block = {k: v for k, v in block.items() if k != "partial_json"}
        if block.get("type") == "tool_use" and "id" not in block:
            block["id"] = f"toolu_fake_{n:03d}_{i}"
        content.append(block)
    stop = planned.stop_reason or (
        "tool_use" if any(b.get("type") == "tool_use" for b in content) else "end_turn"
    )
    body = request.body if isinstance(request.body, dict) else {}
    return {
        "id": f"msg_fake_{n:04d}",
        "type": "message",
        "role": "assistant",
        "model": planned.model or body.get("model") or fake.model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": dict(planned.usage),
    }


_TOOL_USE_ID = re.compile(r"[a-zA-Z0-9_-]+")


def refusal(messages: list[Any]) -> str | None:
    """What the real Messages API says of a transcript it refuses (400), or None."""
    expected: set[str] = set()  # the tool_use ids the next message must answer
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        blocks = content if isinstance(content, list) else []
        answered = set()
        for j, block in enumerate(blocks):
            kind = block.get("type")
            if kind == "text" and not str(block.get("text", "")).strip():
                return "messages: text content blocks must contain non-whitespace text"
            if kind == "tool_use" and not _TOOL_USE_ID.fullmatch(str(block.get("id"))):
                return (
                    f"messages.{i}.content.{j}.tool_use.id: String should match pattern"
                    " '^[a-zA-Z0-9_-]+$'"
                )
            if kind == "tool_result":
                if block.get("tool_use_id") not in expected:
                    return (
                        f"messages.{i}.content.{j}: unexpected `tool_use_id` found in"
                        " `tool_result` blocks: Each `tool_result` block must have a"
                        " corresponding `tool_use` block in the previous message."
                    )
                answered.add(block["tool_use_id"])
        if expected - answered:
            return (
                f"messages.{i}: `tool_use` ids were found without `tool_result` blocks"
                f" immediately after: {', '.join(sorted(expected - answered))}"
            )
        expected = (
            {str(b.get("id")) for b in blocks if b.get("type") == "tool_use"}
            if message.get("role") == "assistant"
            else set()
        )
    return None


def _chunks(value: str, size: int = 7) -> list[str]:
    return [value[i : i + size] for i in range(0, len(value), size)] or []


def make_model(fake: FakeAnthropic, **kwargs: Any) -> Any:
    """An AnthropicModel on the real SDK pointed at ``fake``, with test-sized backoff.

    ``fake.client()`` keeps the SDK's default max_retries=2: the model must switch it off.
    """
    from agentruns.models import AnthropicModel

    kwargs.setdefault("retry_base_s", 0.001)
    kwargs.setdefault("retry_cap_s", 0.01)
    return AnthropicModel("claude-test", client=fake.client(), **kwargs)
