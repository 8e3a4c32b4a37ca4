"""AnthropicModel through the real anthropic SDK against a local Messages API server.

Anthropic's API can't be reached from tests, so tests/fake_anthropic.py stands in for
it at the HTTP level: everything from the SDK down (request building, SSE
parsing, error classes, headers) is the real thing.
"""

from __future__ import annotations

import json
import pickle
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from agentruns.models import ModelAborted, ModelError, ModelRequest, ToolSpec
from agentruns.models.anthropic import AnthropicModel
from agentruns.runs import Usage
from tests.fake_anthropic import (
    FakeAnthropic,
    RawReply,
    dropped,
    error,
    events,
    make_model,
    reply,
    slow,
    text,
    thinking,
    tool_use,
    unstreamed,
    usage,
)

EPHEMERAL = {"type": "ephemeral"}
SEARCH = ToolSpec(
    name="search_issues",
    description="Search the tracker.",
    input_schema={
        "type": "object",
        "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "default": 5}},
        "required": ["query"],
    },
)


@pytest.fixture
def fake() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


def request(
    messages: list[dict[str, Any]] | None = None,
    *,
    system: str = "You triage bug reports.",
    tools: list[ToolSpec] | None = None,
) -> ModelRequest:
    return ModelRequest(
        system=system,
        messages=messages if messages is not None else [{"role": "user", "content": "hi"}],
        tools=tools if tools is not None else [SEARCH],
    )


def tool_loop_transcript() -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": '{"source": "github", "payload": {"issue": 7}}'},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Looking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "search_issues",
                    "input": {"query": "crash"},
                },
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "[]"}],
        },
    ]


def reverse_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: reverse_keys(value[key]) for key in reversed(list(value))}
    if isinstance(value, list):
        return [reverse_keys(item) for item in value]
    return value


# --- the request ------------------------------------------------------------


def test_request_carries_cached_system_tools_and_marks_the_newest_two_cache_points(
    fake: FakeAnthropic,
) -> None:
    fake.push(reply(text("Done.")))
    transcript = tool_loop_transcript()
    before = [dict(m) for m in transcript]

    make_model(fake, max_tokens=1000).complete(request(transcript), threading.Event())

    [sent] = fake.requests
    body = sent.body
    assert sent.path == "/v1/messages"
    assert sent.api_key == "test"
    assert body["model"] == "claude-test"
    assert body["max_tokens"] == 1000
    assert body["stream"] is True
    assert body["system"] == [
        {"type": "text", "text": "You triage bug reports.", "cache_control": EPHEMERAL}
    ]
    assert body["tools"] == [
        {
            "name": "search_issues",
            "description": "Search the tracker.",
            "input_schema": SEARCH.input_schema,
        }
    ]
    # The previous request's newest message is marked too: its cache entry is there.
    assert body["messages"][0] == {
        "role": "user",
        "content": [{"type": "text", "text": transcript[0]["content"], "cache_control": EPHEMERAL}],
    }
    assert body["messages"][1] == transcript[1]
    assert body["messages"][2] == {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_1",
                "content": "[]",
                "cache_control": EPHEMERAL,
            }
        ],
    }
    assert transcript == before  # the engine's messages are never mutated


def test_string_content_of_the_newest_message_becomes_one_cached_text_block(
    fake: FakeAnthropic,
) -> None:
    fake.push(reply(text("Hello.")))
    make_model(fake).complete(request([{"role": "user", "content": "hi"}]), threading.Event())

    assert fake.requests[0].body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": EPHEMERAL}]}
    ]


def test_empty_instructions_and_no_tools_send_neither_field(fake: FakeAnthropic) -> None:
    # Blank instructions too (a template that rendered to a newline): the API takes no
    # text block of whitespace alone.
    for system in ("", "\n", "  \t "):
        fake.push(reply(text("Hello.")))
        make_model(fake).complete(request(system=system, tools=[]), threading.Event())

    for sent in fake.requests:
        assert "system" not in sent.body
        assert "tools" not in sent.body


def test_the_same_transcript_serialises_to_the_same_bytes_whatever_its_key_order(
    fake: FakeAnthropic,
) -> None:
    fake.push(reply(text("a")), reply(text("b")))
    transcript = tool_loop_transcript()
    model = make_model(fake)

    model.complete(request(transcript), threading.Event())
    # As a store that sorts keys its own way (Postgres JSONB) would hand it back.
    model.complete(request(reverse_keys(transcript)), threading.Event())

    assert fake.requests[0].raw == fake.requests[1].raw


def test_extra_create_kwargs_reach_the_request_body(fake: FakeAnthropic) -> None:
    fake.push(reply(text("ok")))
    model = make_model(fake, temperature=0.0, stop_sequences=["STOP"])
    model.complete(request(), threading.Event())

    assert fake.requests[0].body["temperature"] == 0.0
    assert fake.requests[0].body["stop_sequences"] == ["STOP"]


# --- the response -----------------------------------------------------------


def test_tool_use_reply_parses_into_tool_use_blocks_with_parsed_input(fake: FakeAnthropic) -> None:
    fake.push(
        reply(
            text("Let me search."),
            tool_use("search_issues", {"query": "crash on start", "limit": 3}, id="toolu_9"),
        )
    )
    response = make_model(fake).complete(request(), threading.Event())

    assert response.stop_reason == "tool_use"
    assert response.content == [
        {"type": "text", "text": "Let me search."},
        {
            "type": "tool_use",
            "id": "toolu_9",
            "name": "search_issues",
            "input": {"query": "crash on start", "limit": 3},
        },
    ]
    assert response.tool_calls == [response.content[1]]
    assert response.model == "claude-test"


def test_usage_including_cache_tokens_comes_from_the_server(fake: FakeAnthropic) -> None:
    fake.push(reply(text("Done."), usage=usage(1200, 42, cache_creation=800, cache_read=300)))
    response = make_model(fake).complete(request(), threading.Event())

    assert response.usage == Usage(
        input_tokens=1200,
        output_tokens=42,
        cache_creation_input_tokens=800,
        cache_read_input_tokens=300,
    )


def test_thinking_blocks_are_kept_as_returned_so_they_can_be_sent_back(
    fake: FakeAnthropic,
) -> None:
    fake.push(reply(thinking("The user wants a search.", "sig-1"), text("Searching.")))
    response = make_model(fake).complete(request(), threading.Event())

    assert response.content == [
        {"type": "thinking", "thinking": "The user wants a search.", "signature": "sig-1"},
        {"type": "text", "text": "Searching."},
    ]


# --- retries ----------------------------------------------------------------


def test_server_tools_are_sent_after_the_agents_and_their_blocks_are_kept_to_send_back(
    fake: FakeAnthropic,
) -> None:
    web_search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    call = {
        "type": "server_tool_use",
        "id": "srvtoolu_1",
        "name": "web_search",
        "input": {"query": "celery acks_late"},
    }
    results = {
        "type": "web_search_tool_result",
        "tool_use_id": "srvtoolu_1",
        "content": [
            {
                "type": "web_search_result",
                "title": "Tasks",
                "url": "https://docs.celeryq.dev/tasks",
                "encrypted_content": "enc-1",
                "page_age": None,
            }
        ],
    }
    cited = {
        "type": "text",
        "text": "Acks come after the task.",
        "citations": [
            {
                "type": "web_search_result_location",
                "cited_text": "acks late",
                "url": "https://docs.celeryq.dev/tasks",
                "title": "Tasks",
                "encrypted_index": "idx-1",
            }
        ],
    }
    fake.push(reply(call, results, cited))
    model = make_model(fake, tools=[web_search])
    response = model.complete(request(), threading.Event())

    sent = fake.requests[0].body["tools"]
    assert [t["name"] for t in sent] == ["search_issues", "web_search"]
    assert sent[1] == web_search
    # What the model found and cited stays in the transcript, for its next turns.
    assert response.content[0] == call
    assert response.content[1]["type"] == "web_search_tool_result"
    assert response.content[1]["content"][0]["encrypted_content"] == "enc-1"
    assert response.content[2] == cited
    assert response.tool_calls == []  # the API ran the search: nothing for the engine
    # ...and goes back to the API as it came.
    transcript = [*request().messages, {"role": "assistant", "content": response.content}]
    fake.push(reply(text("ok")))
    model.complete(request([*transcript, {"role": "user", "content": "more?"}]), threading.Event())
    assert fake.requests[1].messages[1]["content"][:2] == [call, response.content[1]]


def test_a_server_tool_named_like_one_of_the_agents_fails_the_call_saying_so(
    fake: FakeAnthropic,
) -> None:
    # The API answers 400 to a request whose tools share a name; it was sent anyway.
    model = make_model(fake, tools=[{"type": "web_search_20250305", "name": "search_issues"}])
    with pytest.raises(ModelError, match="'search_issues' has the name of a server tool"):
        model.complete(request(), threading.Event())
    assert fake.requests == []


@pytest.mark.parametrize("tool_marks", [0, 1, 2, 3])
def test_a_request_carries_at_most_the_four_cache_marks_the_api_takes(
    fake: FakeAnthropic, tool_marks: int
) -> None:
    # Server tools may carry marks of their own: with two, the system's and two
    # messages' made five, which the API refuses.
    tools = [
        {"type": "web_search_20250305", "name": f"search_{i}", "cache_control": EPHEMERAL}
        for i in range(tool_marks)
    ]
    fake.push(reply(text("ok")))
    make_model(fake, tools=tools).complete(request(tool_loop_transcript()), threading.Event())
    body = fake.requests[0].body
    marks = json.dumps([body["system"], body["tools"], body["messages"]]).count("cache_control")
    assert marks == min(4, 3 + tool_marks)
    # The newest message first, while there is room.
    assert ("cache_control" in json.dumps(body["messages"][-1])) == (tool_marks < 3)


def test_tools_given_to_the_model_must_be_a_list_of_definitions() -> None:
    with pytest.raises(TypeError, match="list of tool definitions"):
        AnthropicModel("claude-x", tools="web_search")


def test_two_overloaded_errors_then_success_take_exactly_three_requests(
    fake: FakeAnthropic,
) -> None:
    fake.push(error(529), error(529), reply(text("Finally.")))
    response = make_model(fake).complete(request(), threading.Event())

    assert response.text == "Finally."
    assert len(fake.requests) == 3


@pytest.mark.parametrize("status", [408, 409, 429, 500, 503, 529])
def test_transient_status_is_retried(fake: FakeAnthropic, status: int) -> None:
    fake.push(error(status), reply(text("ok")))
    assert make_model(fake).complete(request(), threading.Event()).text == "ok"
    assert len(fake.requests) == 2


def test_the_servers_x_should_retry_header_is_obeyed_as_the_sdk_would(
    fake: FakeAnthropic,
) -> None:
    fake.push(error(529, headers={"x-should-retry": "false"}))
    with pytest.raises(ModelError):
        make_model(fake).complete(request(), threading.Event())
    assert len(fake.requests) == 1

    fake.push(error(400, headers={"x-should-retry": "true"}), reply(text("ok")))
    assert make_model(fake).complete(request(), threading.Event()).text == "ok"
    assert len(fake.requests) == 3


def test_errors_a_client_middleware_marks_retryable_are_retried(fake: FakeAnthropic) -> None:
    def connection_error_behind_another() -> Exception:
        try:
            raise anthropic.APIConnectionError(request=None)  # type: ignore[arg-type]
        except anthropic.APIConnectionError as cause:
            try:
                raise LookupError("the proxy refused") from cause
            except LookupError as wrapped:
                return wrapped

    for make in (lambda: anthropic.RetryableError("try again"), connection_error_behind_another):
        attempts: list[int] = []

        def flaky_once(req: Any, call_next: Any, make: Any = make, attempts: Any = attempts) -> Any:
            attempts.append(1)
            if len(attempts) == 1:
                raise make()
            return call_next(req)

        fake.push(reply(text("ok")))
        client = fake.client(middleware=[flaky_once])
        model = AnthropicModel("claude-test", client=client, max_retries=2, retry_base_s=0.001)
        assert model.complete(request(), threading.Event()).text == "ok"
        assert len(attempts) == 2


@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422])
def test_client_error_fails_at_once_with_model_error(fake: FakeAnthropic, status: int) -> None:
    fake.push(error(status, message="messages: roles must alternate"), reply(text("unused")))

    with pytest.raises(ModelError, match="roles must alternate"):
        make_model(fake).complete(request(), threading.Event())
    assert len(fake.requests) == 1


def test_authentication_error_says_to_check_the_api_key(fake: FakeAnthropic) -> None:
    fake.push(error(401, message="invalid x-api-key"))
    with pytest.raises(ModelError, match="ANTHROPIC_API_KEY"):
        make_model(fake).complete(request(), threading.Event())


def test_permanent_overload_fails_after_max_retries_plus_one_requests(
    fake: FakeAnthropic,
) -> None:
    fake.push(*[error(529, message="Overloaded") for _ in range(10)])

    with pytest.raises(ModelError, match=r"after 3 tries: overloaded_error .*Overloaded"):
        make_model(fake, max_retries=2).complete(request(), threading.Event())
    assert len(fake.requests) == 3


def test_zero_max_retries_means_a_single_try(fake: FakeAnthropic) -> None:
    fake.push(error(529), reply(text("unused")))
    with pytest.raises(ModelError):
        make_model(fake, max_retries=0).complete(request(), threading.Event())
    assert len(fake.requests) == 1


@pytest.mark.parametrize(
    "header", [{"retry_after_ms": 300}, {"retry_after": 0.3}], ids=["retry-after-ms", "retry-after"]
)
def test_retry_after_header_sets_the_wait_before_the_next_try(
    fake: FakeAnthropic, header: dict[str, Any]
) -> None:
    fake.push(error(429, **header), reply(text("ok")))
    make_model(fake).complete(request(), threading.Event())

    first, second = fake.requests
    assert 0.28 <= second.at - first.at < 2.0


@pytest.mark.parametrize("value", ["0", "-3", "Wed, 21 Oct 2015 07:28:00 GMT"])
def test_a_retry_after_of_no_time_backs_off_as_the_sdk_would(
    fake: FakeAnthropic, value: str
) -> None:
    fake.push(error(429, headers={"retry-after": value}), reply(text("ok")))
    make_model(fake, retry_base_s=0.4, retry_cap_s=0.4).complete(request(), threading.Event())

    first, second = fake.requests
    assert second.at - first.at >= 0.19  # jittered backoff: 0.2 to 0.4 s, not at once


def test_overloaded_error_inside_the_stream_is_retried(fake: FakeAnthropic) -> None:
    fake.push(reply(text("x"), stream_error="overloaded_error"), reply(text("ok")))
    assert make_model(fake).complete(request(), threading.Event()).text == "ok"
    assert len(fake.requests) == 2


def test_invalid_request_error_inside_the_stream_fails_at_once(fake: FakeAnthropic) -> None:
    fake.push(reply(text("x"), stream_error="invalid_request_error"), reply(text("unused")))
    with pytest.raises(ModelError, match="invalid_request_error"):
        make_model(fake).complete(request(), threading.Event())
    assert len(fake.requests) == 1


def test_a_stream_cut_off_mid_body_is_retried(fake: FakeAnthropic) -> None:
    fake.push(dropped(), reply(text("ok")))
    assert make_model(fake).complete(request(), threading.Event()).text == "ok"
    assert len(fake.requests) == 2


def test_a_stream_cut_off_every_time_says_so_not_that_the_api_was_unreachable(
    fake: FakeAnthropic,
) -> None:
    fake.push(dropped(), dropped())
    with pytest.raises(ModelError) as err:
        make_model(fake, max_retries=1).complete(request(), threading.Event())
    assert "response stream was cut off after 2 tries" in str(err.value)
    assert "could not reach" not in str(err.value)


@pytest.mark.parametrize(
    "answer",
    [unstreamed(), RawReply("text/html", b"<html>sign in</html>")],
    ids=["whole-json", "html-page"],
)
def test_a_whole_answer_that_is_no_stream_fails_at_once(
    fake: FakeAnthropic, answer: RawReply
) -> None:
    # A gateway that answers a stream's request with one JSON message (or a proxy's
    # page) was taken for a stream cut off: sent again four times, each billed, then
    # "the response stream was cut off after 5 tries".
    fake.push(answer, reply(text("never asked")))
    with pytest.raises(ModelError) as err:
        make_model(fake, max_retries=4).complete(request(), threading.Event())
    assert len(fake.requests) == 1
    said = str(err.value)
    assert said.startswith("malformed model reply: the API answered with ")
    assert answer.content_type in said and "not an event stream" in said


_START = {
    "type": "message_start",
    "message": {
        "id": "msg_odd",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 5, "output_tokens": 1},
    },
}
_END = [
    {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": 3},
    },
    {"type": "message_stop"},
]
_DELTA = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x"}}


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (events(_START, *_END), "no list of content blocks: content=None"),
        (events(_DELTA, *_END), "do not make a message (AssertionError)"),
        (
            events({**_START, "message": {**_START["message"], "content": []}}, _DELTA, *_END),
            "do not make a message (IndexError: list index out of range)",
        ),
        (events("{not json"), "do not make a message (JSONDecodeError: Expecting property"),
    ],
    ids=["start-without-content", "delta-before-start", "delta-of-no-block", "not-json"],
)
def test_a_stream_whose_events_make_no_message_fails_at_once_as_malformed(
    fake: FakeAnthropic, answer: RawReply, said: str
) -> None:
    # A message_start without content raised a bare TypeError out of complete()
    # ("'NoneType' object is not iterable"); the others failed as "the Anthropic call
    # failed: AssertionError: " and the like.
    fake.push(answer, reply(text("never asked")))
    with pytest.raises(ModelError) as err:
        make_model(fake, max_retries=2).complete(request(), threading.Event())
    assert len(fake.requests) == 1
    assert str(err.value).startswith("malformed model reply: the "), err.value
    assert said in str(err.value)


def _text_reply(usage: dict[str, Any], output_tokens: Any = 3) -> RawReply:
    """A reply of one text block whose message_start holds ``usage``."""
    start = {**_START, "message": {**_START["message"], "content": [], "usage": usage}}
    block = {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    stop = {"type": "content_block_stop", "index": 0}
    end = {**_END[0], "usage": {"output_tokens": output_tokens}}
    return events(start, block, _DELTA, stop, end, _END[1])


@pytest.mark.parametrize(
    "usage", [{"output_tokens": 1}, {"input_tokens": None, "output_tokens": 1}]
)
def test_a_stream_whose_usage_leaves_a_count_out_counts_it_as_none(
    fake: FakeAnthropic, usage: dict[str, Any]
) -> None:
    # A gateway that leaves input_tokens out of message_start: taken for 0, as before
    # the check that a stream's events make a message (which failed it as malformed).
    fake.push(_text_reply(usage))
    response = make_model(fake).complete(request(), threading.Event())
    assert response.content == [{"type": "text", "text": "x"}]
    assert (response.usage.input_tokens, response.usage.output_tokens) == (0, 3)


@pytest.mark.parametrize(
    ("usage", "output_tokens", "said"),
    [
        ({"input_tokens": 2.5}, 3, "usage.input_tokens is 2.5, not a count"),
        ({"input_tokens": -4}, 3, "usage.input_tokens is -4, not a count"),
        ({"input_tokens": "12 tokens"}, 3, "usage.input_tokens is '12 tokens', not a count"),
        (
            {"input_tokens": 1, "cache_read_input_tokens": [2]},
            3,
            "usage.cache_read_input_tokens is [2], not a count",
        ),
        ({"input_tokens": 1}, 1.5, "usage.output_tokens is 1.5, not a count"),
    ],
)
@pytest.mark.filterwarnings("ignore::UserWarning")  # the SDK's, as it builds the message
def test_a_stream_whose_usage_holds_no_count_fails_as_malformed_in_one_line(
    fake: FakeAnthropic, usage: dict[str, Any], output_tokens: Any, said: str
) -> None:
    # A float failed the run with pydantic's multi-line text; a negative count was
    # taken and lowered the run's usage against its budget.
    fake.push(_text_reply(usage, output_tokens), reply(text("never asked")))
    with pytest.raises(ModelError) as err:
        make_model(fake, max_retries=2).complete(request(), threading.Event())
    assert len(fake.requests) == 1
    assert str(err.value) == f"malformed model reply: {said}"


@pytest.mark.filterwarnings("ignore::UserWarning")  # the SDK's, as it builds the message
def test_a_stream_whose_counts_are_whole_floats_or_digits_counts_them(
    fake: FakeAnthropic,
) -> None:
    fake.push(_text_reply({"input_tokens": 12.0, "cache_read_input_tokens": "7"}, 3.0))
    response = make_model(fake).complete(request(), threading.Event())
    assert (response.usage.input_tokens, response.usage.output_tokens) == (12, 3)
    assert response.usage.cache_read_input_tokens == 7


def test_unreachable_server_fails_with_a_connection_message_after_retries() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = anthropic.Anthropic(api_key="test", base_url=f"http://127.0.0.1:{port}")
    model = AnthropicModel("claude-test", client=client, max_retries=1, retry_base_s=0.001)

    with pytest.raises(ModelError, match=r"could not reach the Anthropic API .* after 2 tries"):
        model.complete(request(), threading.Event())

    # A gateway's credentials in the base URL stay out of the message (stored with the run).
    secret = f"http://gateway:hunter2@127.0.0.1:{port}/v1?key=sk-gateway"
    client = anthropic.Anthropic(api_key="test", base_url=secret)
    model = AnthropicModel("claude-test", client=client, max_retries=0)
    with pytest.raises(ModelError) as failed:
        model.complete(request(), threading.Event())
    assert f"at http://127.0.0.1:{port}/v1" in str(failed.value)
    assert "hunter2" not in str(failed.value) and "sk-gateway" not in str(failed.value)


# --- aborts -----------------------------------------------------------------


def _aborted_while_stalled(fake: FakeAnthropic, requests: int) -> tuple[dict[str, Any], Any]:
    """Call the model in a thread, and set its abort signal once the stream of its
    ``requests``-th request stalls after message_start (read by the client by then):
    what the call raised ("error"), when it ended ("done_at") and when the signal was
    set ("set_at"), and that request."""
    signal = threading.Event()
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            make_model(fake).complete(request(), signal)
        except BaseException as exc:
            outcome["error"] = exc
        outcome["done_at"] = time.monotonic()

    caller = threading.Thread(target=call)
    caller.start()
    stalled = fake.wait_for_requests(requests)[-1]
    assert stalled.stalled.wait(5)  # message_start sent; the server now says nothing
    time.sleep(0.5)  # for the client to read it (its usage)
    outcome["set_at"] = time.monotonic()
    signal.set()
    caller.join(timeout=5)
    return outcome, stalled


def test_abort_during_a_slow_stream_raises_within_half_a_second(fake: FakeAnthropic) -> None:
    fake.push(slow(30.0))
    outcome, stalled = _aborted_while_stalled(fake, 1)
    assert isinstance(outcome.get("error"), ModelAborted)
    assert outcome["done_at"] - outcome["set_at"] < 0.5
    assert stalled.disconnected.wait(1)  # the HTTP response was closed, not left hanging


def test_an_aborted_call_carries_what_the_provider_counted_before_the_hang_up(
    fake: FakeAnthropic,
) -> None:
    # A cancelled or timed-out run's usage left out the call it stopped, billed for its
    # paused turns and its input (the output is reported at the end of a reply).
    paused = reply(text("Searching..."), stop_reason="pause_turn", usage=usage(5000, 300))
    fake.push(paused, slow(30.0, reply(text("late"), usage=usage(3000, 50, cache_read=900))))
    outcome, _ = _aborted_while_stalled(fake, 2)
    aborted = outcome.get("error")
    assert isinstance(aborted, ModelAborted)
    # message_start says the input, and one output token so far.
    assert aborted.usage == Usage(input_tokens=8000, output_tokens=301, cache_read_input_tokens=900)
    assert pickle.loads(pickle.dumps(aborted)).usage == aborted.usage


def test_a_time_limit_during_a_stream_hangs_up_on_it(fake: FakeAnthropic) -> None:
    # A Celery worker's time limit, raised where the caller waits for the stream:
    # it was raised on, and the request went on streaming (and billing) behind it.
    from celery.exceptions import SoftTimeLimitExceeded

    fake.push(slow(30.0))

    class LimitedAfterAWhile(threading.Event):
        started = 0.0

        def is_set(self) -> bool:
            if self.started and time.monotonic() - self.started > 0.3:
                raise SoftTimeLimitExceeded()
            return super().is_set()

    signal = LimitedAfterAWhile()
    signal.started = time.monotonic()
    with pytest.raises(SoftTimeLimitExceeded):
        make_model(fake).complete(request(), signal)
    [stalled] = fake.wait_for_requests(1)
    assert stalled.disconnected.wait(1)


def test_abort_during_the_retry_wait_stops_it_early(fake: FakeAnthropic) -> None:
    fake.push(error(529, retry_after=30), reply(text("unused")))
    signal = threading.Event()
    threading.Timer(0.2, signal.set).start()

    started = time.monotonic()
    with pytest.raises(ModelAborted):
        make_model(fake).complete(request(), signal)
    assert time.monotonic() - started < 1.0
    assert len(fake.requests) == 1


def test_an_already_set_signal_sends_nothing(fake: FakeAnthropic) -> None:
    signal = threading.Event()
    signal.set()
    with pytest.raises(ModelAborted):
        make_model(fake).complete(request(), signal)
    assert fake.requests == []


# --- stop reasons -------------------------------------------------------------


def test_pause_turn_continues_with_the_assistant_content_and_merges_the_turn(
    fake: FakeAnthropic,
) -> None:
    fake.push(
        reply(text("Searching the web..."), stop_reason="pause_turn", usage=usage(100, 10)),
        reply(text("Found it."), usage=usage(150, 20, cache_read=90)),
    )
    response = make_model(fake).complete(request(), threading.Event())

    assert response.stop_reason == "end_turn"
    assert response.content == [
        {"type": "text", "text": "Searching the web..."},
        {"type": "text", "text": "Found it."},
    ]
    assert response.usage == Usage(input_tokens=250, output_tokens=30, cache_read_input_tokens=90)
    first, second = fake.requests
    assert second.messages[0] == first.messages[0]  # where the first request's entry is
    assert second.messages[1] == {
        "role": "assistant",
        "content": [{"type": "text", "text": "Searching the web...", "cache_control": EPHEMERAL}],
    }
    assert second.body["system"] == first.body["system"]


def test_what_the_server_said_is_kept_in_one_shortened_line(
    fake: FakeAnthropic, caplog: pytest.LogCaptureFixture
) -> None:
    # A proxy's 502 page of 20,000 lines was the run's error, and each retry's log line.
    page = "<p>Bad gateway upstream error</p>\n" * 20_000
    fake.push(error(502, message=page), error(502, message=page))
    with caplog.at_level("WARNING"), pytest.raises(ModelError) as err:
        make_model(fake, max_retries=1).complete(request(), threading.Event())
    said = str(err.value)
    assert said.startswith("Anthropic API error after 2 tries: api_error (HTTP 502): <p>Bad")
    assert "\n" not in said and len(said) < 1200 and said.endswith("more characters)")
    retried = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retried) == 1 and "\n" not in retried[0] and len(retried[0]) < 1200


def test_a_call_id_an_earlier_release_renamed_is_sent_as_the_api_takes_it(
    fake: FakeAnthropic,
) -> None:
    # Stored as "toolu_1~2" (refused by the API's id pattern): the run failed with a
    # 400, and every retry again.
    messages = [
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": [tool_use("search_issues", {}, id="toolu_1~2")]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1~2", "content": "[]"}],
        },
    ]
    fake.push(reply(text("Done.")))
    make_model(fake).complete(request(messages), threading.Event())
    assert fake.refused == []
    sent = fake.requests[0].messages
    assert sent[1]["content"][0]["id"] == "toolu_1-2"
    assert sent[2]["content"][0]["tool_use_id"] == "toolu_1-2"
    assert messages[1]["content"][0]["id"] == "toolu_1~2"  # the transcript is untouched


def test_a_paused_turns_blank_text_is_not_sent_back_in_its_continuation(
    fake: FakeAnthropic,
) -> None:
    # The API refuses a blank text block in a request: the continuation of a turn
    # paused as [text(""), server_tool_use] got a 400, and the run failed.
    call = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}
    found = {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []}
    fake.push(
        reply(text(""), call, stop_reason="pause_turn", usage=usage(100, 10)),
        reply(found, text("Found it."), usage=usage(150, 20)),
    )
    web_search = {"type": "web_search_20250305", "name": "web_search"}
    response = make_model(fake, tools=[web_search]).complete(request(), threading.Event())

    assert fake.refused == []
    assert response.stop_reason == "end_turn"
    assert fake.requests[1].messages[-1]["content"][0]["type"] == "server_tool_use"
    assert response.content[-1] == text("Found it.")


@pytest.mark.parametrize("then", ["refused", "cut", "uncountable", "cut and uncountable"])
@pytest.mark.filterwarnings("ignore::UserWarning")  # the SDK's, as it builds the message
def test_a_paused_turns_tokens_count_when_its_continuation_fails(
    fake: FakeAnthropic, then: str
) -> None:
    paused = reply(text("Searching..."), stop_reason="pause_turn", usage=usage(5000, 300))
    if then == "refused":
        fake.push(paused, error(400, message="bad continuation"))
        spent = Usage(input_tokens=5000, output_tokens=300)
    elif then == "cut":
        cut = tool_use("search_issues", partial_json='{"query": "cra"')
        fake.push(paused, reply(cut, usage=usage(3000, 50)))
        spent = Usage(input_tokens=8000, output_tokens=350)
    else:
        # Its continuation's usage holds no count: the paused turn's tokens were lost
        # with it, and a cut input was said as the count's problem.
        block = (
            tool_use("search_issues", partial_json='{"query": "cra"')
            if "cut" in then
            else text("x")
        )
        odd = {**usage(3000, 50), "input_tokens": 2.5}
        fake.push(paused, reply(block, usage=odd))  # type: ignore[arg-type]
        spent = Usage(input_tokens=5000, output_tokens=300)
    with pytest.raises(ModelError) as err:
        make_model(fake).complete(request(), threading.Event())
    assert err.value.usage == spent
    if "cut" in then:
        assert "'search_issues' is not complete JSON" in str(err.value), err.value


def test_refusal_fails_with_model_error_and_the_tokens_it_spent(fake: FakeAnthropic) -> None:
    fake.push(reply(text("I can't help with that."), stop_reason="refusal", usage=usage(40, 9)))
    with pytest.raises(ModelError, match="refused") as err:
        make_model(fake).complete(request(), threading.Event())
    assert err.value.usage == Usage(input_tokens=40, output_tokens=9)


def test_a_tool_call_whose_input_json_is_cut_short_fails_though_the_reply_is_whole(
    fake: FakeAnthropic,
) -> None:
    # The SDK reads tool input leniently: '{"query": "cra"' would become {"query": "cra"}
    # and the call would run with part of its arguments.
    fake.push(reply(tool_use("search_issues", partial_json='{"query": "cra"'), usage=usage(30, 4)))
    with pytest.raises(ModelError, match="'search_issues' is not complete JSON") as err:
        make_model(fake).complete(request(), threading.Event())
    assert err.value.usage == Usage(input_tokens=30, output_tokens=4)
    assert len(fake.requests) == 1  # a whole reply: not retried


def test_max_tokens_inside_a_tool_call_fails_instead_of_leaving_it_unanswered(
    fake: FakeAnthropic,
) -> None:
    fake.push(
        reply(
            text("Searching."),
            tool_use("search_issues", partial_json='{"query": "cra'),
            stop_reason="max_tokens",
        )
    )
    with pytest.raises(ModelError, match=r"cut off \(stop_reason=max_tokens\)"):
        make_model(fake).complete(request(), threading.Event())
    assert len(fake.requests) == 1


def test_max_tokens_with_only_text_is_returned_as_it_is(fake: FakeAnthropic) -> None:
    fake.push(reply(text("A long answer that got cu"), stop_reason="max_tokens"))
    response = make_model(fake).complete(request(), threading.Event())

    assert response.stop_reason == "max_tokens"
    assert response.text == "A long answer that got cu"
    assert response.tool_calls == []


def test_max_tokens_spent_on_thinking_before_any_answer_fails_with_the_tokens(
    fake: FakeAnthropic,
) -> None:
    fake.push(
        reply(
            thinking("Let me think about this at length"),
            stop_reason="max_tokens",
            usage=usage(70, 4096),
        )
    )
    with pytest.raises(ModelError, match=r"cut off .*before it answered") as err:
        make_model(fake).complete(request(), threading.Event())
    assert err.value.usage == Usage(input_tokens=70, output_tokens=4096)


def test_context_window_exceeded_inside_a_tool_call_fails(fake: FakeAnthropic) -> None:
    fake.push(
        reply(
            tool_use("search_issues", {"query": "x"}),
            stop_reason="model_context_window_exceeded",
        )
    )
    with pytest.raises(ModelError, match="model_context_window_exceeded"):
        make_model(fake).complete(request(), threading.Event())


def test_name_is_the_model_id() -> None:
    assert AnthropicModel("claude-sonnet-4-5").name == "claude-sonnet-4-5"


def test_the_default_client_is_created_only_when_first_called(
    monkeypatch: pytest.MonkeyPatch, fake: FakeAnthropic
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "from-env")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", fake.url)
    model = AnthropicModel("claude-test", retry_base_s=0.001)
    assert fake.requests == []
    fake.push(error(529), reply(text("ok")))

    assert model.complete(request(), threading.Event()).text == "ok"
    assert fake.requests[0].api_key == "from-env"
    assert len(fake.requests) == 2  # the default client doesn't retry on its own either
