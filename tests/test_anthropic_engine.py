"""Whole runs through the Engine with AnthropicModel, on the real Postgres and Redis.

The real ``anthropic`` SDK talks to tests/fake_anthropic.py, a local server speaking
the Messages API, so these tests see the HTTP requests a run makes and what the
engine stores from the replies.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agentruns import Agent, RunStatus, Usage, tool
from agentruns.engine import Engine
from agentruns.runs import Run
from agentruns.schedulers import ManualScheduler
from agentruns.transcript import tool_calls, validate
from tests.conftest import EngineFactory, Errors, trigger
from tests.fake_anthropic import (
    FakeAnthropic,
    RecordedRequest,
    error,
    make_model,
    reply,
    slow,
    text,
    tool_use,
    usage,
)

EPHEMERAL = {"type": "ephemeral"}
INSTRUCTIONS = "You triage bug reports."


@tool
def search_issues(query: str, limit: int = 5) -> list[dict[str, Any]]:
    """Search the tracker."""
    return [{"id": i, "title": f"{query} {i}"} for i in range(limit)]


@tool
def label_issue(issue: int, labels: list[str]) -> dict[str, Any]:
    """Put labels on an issue."""
    return {"issue": issue, "labels": labels}


@pytest.fixture
def fake() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


def triage_agent(fake: FakeAnthropic, **kwargs: Any) -> Agent:
    return Agent(
        "triage",
        make_model(fake, **kwargs),
        instructions=INSTRUCTIONS,
        tools=[search_issues, label_issue],
    )


def manual_engine(make_engine: EngineFactory, agent: Agent) -> Engine:
    """An engine whose executions run on the test's thread, when it calls execute()."""
    return make_engine([agent], scheduler=ManualScheduler())


def run_to_end(engine: Engine, payload: Any = None) -> Run:
    run = engine.dispatch("triage", trigger(payload if payload is not None else {"issue": 7}))
    engine.execute(run.id)
    return engine.get_run(run.id)


def without_cache_control(value: Any) -> Any:
    """What was sent as the transcript stores it: no cache marks, and a user message's
    text as the string it is stored as (a mark needs it as a block)."""
    if isinstance(value, dict):
        stripped = {k: without_cache_control(v) for k, v in value.items() if k != "cache_control"}
        content = stripped.get("content")
        single = isinstance(content, list) and len(content) == 1 and content[0].get("type")
        if stripped.get("role") == "user" and single == "text":
            stripped["content"] = content[0]["text"]
        return stripped
    if isinstance(value, list):
        return [without_cache_control(item) for item in value]
    return value


def cache_marks(value: Any) -> int:
    return json.dumps(value).count('"cache_control"')


def assert_valid_conversation(messages: list[dict[str, Any]]) -> None:
    """Roles alternate from a user turn; each tool_use is answered, in order, in the next turn."""
    assert messages, "no messages"
    for i, message in enumerate(messages):
        assert message["role"] == ("user" if i % 2 == 0 else "assistant"), [
            m["role"] for m in messages
        ]
        content = message["content"]
        calls = [b["id"] for b in content if isinstance(content, list) and b["type"] == "tool_use"]
        if calls:
            assert i + 1 < len(messages), f"the tool calls of message {i} are unanswered"
            answer = messages[i + 1]["content"]
            assert isinstance(answer, list)
            answered = [b["tool_use_id"] for b in answer if b["type"] == "tool_result"]
            assert answered == calls


def sdk_retries(request: RecordedRequest) -> str | None:
    """How many times the SDK itself had retried when it sent this request."""
    return request.headers.get("x-stainless-retry-count")


# --- a whole tool loop ------------------------------------------------------------


def test_tool_loop_completes_and_every_request_is_a_valid_messages_call(
    make_engine: EngineFactory, fake: FakeAnthropic, errors: Errors
) -> None:
    fake.push(
        reply(
            text("Let me look."),
            tool_use("search_issues", {"query": "crash", "limit": 2}, id="toolu_a"),
        ),
        reply(
            tool_use("label_issue", {"issue": 7, "labels": ["bug"]}, id="toolu_b"),
            tool_use("search_issues", {"query": "dup"}, id="toolu_c"),
        ),
        reply(text("Labelled #7 as a bug.")),
    )
    engine = manual_engine(make_engine, triage_agent(fake))

    run = run_to_end(engine, {"title": "App crashes"})

    assert run.status is RunStatus.COMPLETED, run.error
    assert run.output == "Labelled #7 as a bug."
    assert errors == []
    assert len(fake.requests) == 3
    for sent in fake.requests:
        body = sent.body
        assert sent.path == "/v1/messages" and body["stream"] is True
        assert body["model"] == "claude-test"
        assert body["system"] == [
            {"type": "text", "text": INSTRUCTIONS, "cache_control": EPHEMERAL}
        ]
        tools = {t["name"]: t for t in body["tools"]}
        assert list(tools) == ["search_issues", "label_issue"]
        assert tools["search_issues"]["description"] == "Search the tracker."
        assert tools["label_issue"]["description"] == "Put labels on an issue."
        search, label = (tools[n]["input_schema"] for n in ("search_issues", "label_issue"))
        assert search["type"] == "object" and search["required"] == ["query"]
        assert search["properties"]["query"]["type"] == "string"
        assert search["properties"]["limit"]["type"] == "integer"
        assert search["properties"]["limit"]["default"] == 5
        assert label["required"] == ["issue", "labels"]
        assert label["properties"]["issue"]["type"] == "integer"
        assert label["properties"]["labels"] == {
            "items": {"type": "string"},
            "title": "Labels",
            "type": "array",
        }
        assert_valid_conversation(sent.messages)
        assert sent.messages[-1]["role"] == "user"

    first, second, third = (r.messages for r in fake.requests)
    assert len(first) == 1 and len(second) == 3 and len(third) == 5
    assert json.loads(first[0]["content"][0]["text"]) == {
        "source": "manual",
        "trigger": "manual",
        "payload": {"title": "App crashes"},
    }
    # Each request extends the previous one with the reply and the tool results.
    assert without_cache_control(third[:3]) == without_cache_control(second)
    assert [b["tool_use_id"] for b in second[2]["content"]] == ["toolu_a"]
    assert json.loads(second[2]["content"][0]["content"]) == [
        {"id": 0, "title": "crash 0"},
        {"id": 1, "title": "crash 1"},
    ]
    assert [b["tool_use_id"] for b in third[4]["content"]] == ["toolu_b", "toolu_c"]
    assert json.loads(third[4]["content"][0]["content"]) == {"issue": 7, "labels": ["bug"]}

    steps = engine.steps(run.id)
    assert [(s.kind, s.name) for s in steps] == [
        ("llm", "claude-test"),
        ("tool", "search_issues"),
        ("llm", "claude-test"),
        ("tool", "label_issue"),
        ("tool", "search_issues"),
        ("llm", "claude-test"),
    ]
    checkpoint = engine.checkpoint(run.id)
    assert checkpoint is not None and checkpoint.finish_reason == "end_turn"
    assert_valid_conversation(checkpoint.messages)
    assert len(checkpoint.messages) == 6


def test_a_gateway_repeating_a_call_id_gets_ids_the_api_takes(
    make_engine: EngineFactory, fake: FakeAnthropic, errors: Errors
) -> None:
    # A gateway that numbers calls per reply: the engine renamed the repeat
    # "toolu_1~2", which the API's id pattern refuses (a 400), failing the run for good.
    fake.push(
        reply(tool_use("search_issues", {"query": "crash"}, id="toolu_1")),
        reply(tool_use("search_issues", {"query": "hang"}, id="toolu_1")),
        reply(text("Two searches.")),
    )
    engine = manual_engine(make_engine, triage_agent(fake))

    run = run_to_end(engine)

    assert run.status is RunStatus.COMPLETED, run.error
    assert fake.refused == [] and errors == []
    last = fake.requests[-1].messages
    assert [b["id"] for b in last[3]["content"] if b["type"] == "tool_use"] == ["toolu_1-2"]
    assert [b["tool_use_id"] for b in last[4]["content"]] == ["toolu_1-2"]


def test_run_usage_is_the_sum_of_the_servers_numbers_including_cache_tokens(
    make_engine: EngineFactory, fake: FakeAnthropic
) -> None:
    fake.push(
        reply(
            tool_use("search_issues", {"query": "crash"}),
            usage=usage(1200, 40, cache_creation=1000),
        ),
        reply(
            tool_use("search_issues", {"query": "again"}),
            usage=usage(300, 25, cache_creation=200, cache_read=1000),
        ),
        reply(text("Done."), usage=usage(90, 7, cache_read=1200)),
    )
    engine = manual_engine(make_engine, triage_agent(fake))

    run = run_to_end(engine)

    assert run.status is RunStatus.COMPLETED, run.error
    assert run.usage == Usage(
        input_tokens=1590,
        output_tokens=72,
        cache_creation_input_tokens=1200,
        cache_read_input_tokens=2200,
    )
    llm_steps = [s for s in engine.steps(run.id) if s.kind == "llm"]
    # Step rows leave zero counts out; read back as a Usage they are the server's numbers.
    assert [Usage(**s.output["usage"]).model_dump() for s in llm_steps] == [
        Usage(input_tokens=1200, output_tokens=40, cache_creation_input_tokens=1000).model_dump(),
        Usage(
            input_tokens=300,
            output_tokens=25,
            cache_creation_input_tokens=200,
            cache_read_input_tokens=1000,
        ).model_dump(),
        Usage(input_tokens=90, output_tokens=7, cache_read_input_tokens=1200).model_dump(),
    ]


# --- failures and retries -----------------------------------------------------------


def test_two_overloaded_errors_then_success_complete_with_one_request_per_try(
    make_engine: EngineFactory, fake: FakeAnthropic, caplog: pytest.LogCaptureFixture
) -> None:
    fake.push(
        error(529, message="Overloaded"),
        error(529, message="Overloaded"),
        reply(text("Finally."), usage=usage(50, 5)),
    )
    engine = manual_engine(make_engine, triage_agent(fake))

    with caplog.at_level("WARNING", logger="agentruns.models.anthropic"):
        run = run_to_end(engine)

    assert run.status is RunStatus.COMPLETED, run.error
    assert run.output == "Finally."
    assert len(fake.requests) == 3
    # Every request is a fresh first try of the SDK (its own retries are off) ...
    assert [sdk_retries(r) for r in fake.requests] == ["0", "0", "0"]
    # ... and of the same request: the retries resend it unchanged.
    assert fake.requests[0].raw == fake.requests[1].raw == fake.requests[2].raw
    retried = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retried) == 2
    # Naming the run (a worker's log interleaves many runs' calls).
    assert all(m.startswith(f"Anthropic call of run {run.id} failed (try ") for m in retried)
    # The failed tries leave no trace in the run: one model step, one reply's usage.
    assert [s.kind for s in engine.steps(run.id)] == ["llm"]
    assert run.usage == Usage(input_tokens=50, output_tokens=5)


def test_a_400_fails_the_run_at_once_with_model_error_and_an_intact_transcript(
    make_engine: EngineFactory, fake: FakeAnthropic, errors: Errors
) -> None:
    problem = "messages.2.content.0: tool_result block too long; shorten the tool output"
    seen: list[Any] = []

    def refuse(request: RecordedRequest) -> Any:
        # What was stored when the failing call went out.
        [queued] = engine.list_runs()
        seen.append((engine.checkpoint(queued.id), engine.store.transcript(queued.id).messages))
        return error(400, message=problem)

    fake.push(reply(tool_use("search_issues", {"query": "crash"}, id="toolu_1")))
    fake.responder = refuse  # every later request: 400 (a retry would show up as a request)
    engine = manual_engine(make_engine, triage_agent(fake))

    run = run_to_end(engine)

    assert run.status is RunStatus.FAILED
    assert run.error is not None and run.error.code == "model_error"
    message = run.error.message
    assert "HTTP 400" in message and "invalid_request_error" in message and problem in message
    assert len(fake.requests) == 2  # one good call, one failing try, no retry
    assert errors == []  # a model error is the run's failure, not an engine fault

    [(before, stored_before)] = seen
    assert before is not None and before.step_index == 0
    after = engine.checkpoint(run.id)
    assert after is not None and after == before
    assert engine.store.transcript(run.id).messages == stored_before == after.messages
    assert [m["role"] for m in after.messages] == ["user", "assistant", "user"]
    assert_valid_conversation(after.messages)
    assert without_cache_control(fake.requests[1].messages) == after.messages
    assert [s.kind for s in engine.steps(run.id)] == ["llm", "tool"]
    assert run.steps_used == 1


def test_a_permanent_overload_fails_the_run_after_exactly_max_retries_plus_one_requests(
    make_engine: EngineFactory, fake: FakeAnthropic
) -> None:
    fake.responder = lambda request: error(529, message="Overloaded")
    engine = manual_engine(make_engine, triage_agent(fake, max_retries=2))

    started = time.monotonic()
    run = run_to_end(engine)

    assert time.monotonic() - started < 5.0
    assert run.status is RunStatus.FAILED
    assert run.error is not None and run.error.code == "model_error"
    assert "after 3 tries" in run.error.message
    assert "overloaded_error" in run.error.message and "Overloaded" in run.error.message
    assert len(fake.requests) == 3
    assert [sdk_retries(r) for r in fake.requests] == ["0", "0", "0"]
    assert engine.steps(run.id) == []
    assert engine.checkpoint(run.id) is None
    assert run.usage == Usage()


@pytest.mark.parametrize("stop_reason", ["max_tokens", "model_context_window_exceeded"])
def test_a_reply_cut_off_inside_a_tool_call_fails_and_stores_no_unanswered_tool_use(
    make_engine: EngineFactory, fake: FakeAnthropic, stop_reason: str
) -> None:
    fake.push(
        reply(tool_use("search_issues", {"query": "crash"}, id="toolu_1")),
        reply(
            text("Let me also search for"),
            tool_use("search_issues", id="toolu_2", partial_json='{"query": "dupl'),
            stop_reason=stop_reason,
        ),
        reply(text("unused")),
    )
    engine = manual_engine(make_engine, triage_agent(fake))

    run = run_to_end(engine)

    assert run.status is RunStatus.FAILED
    assert run.error is not None and run.error.code == "model_error"
    assert f"stop_reason={stop_reason}" in run.error.message
    assert len(fake.requests) == 2 and fake.pending == 1  # not retried
    stored = engine.store.transcript(run.id).messages
    validate(stored)  # every tool_use before the last message is answered
    assert not tool_calls(stored[-1])  # and the last one asks for none
    assert_valid_conversation(stored)
    assert "toolu_2" not in json.dumps(stored)
    checkpoint = engine.checkpoint(run.id)
    assert checkpoint is not None and checkpoint.messages == stored
    assert [s.kind for s in engine.steps(run.id)] == ["llm", "tool"]


# --- cancel ---------------------------------------------------------------------------


def test_cancel_from_another_engine_during_a_slow_stream_settles_within_a_second(
    make_engine: EngineFactory, fake: FakeAnthropic, errors: Errors
) -> None:
    fake.push(slow(30.0, reply(text("too late"), usage=usage(1500, 40, cache_read=700))))
    agent = triage_agent(fake)
    # A long lease: its renewal (every lease_ttl/3) can't be what delivers the cancel.
    owner = make_engine([agent], lease_ttl=30.0)
    other = make_engine([agent], scheduler=ManualScheduler())

    run = owner.dispatch("triage", trigger({"issue": 7}))
    [stalled] = fake.wait_for_requests(1)
    assert stalled.stalled.wait(5)  # message_start sent, then the server says nothing
    time.sleep(0.5)  # for the client to read it (its usage)

    asked = time.monotonic()
    assert other.cancel(run.id).cancel_requested
    deadline = asked + 5.0
    while other.get_run(run.id).status is not RunStatus.CANCELLED:
        assert time.monotonic() < deadline, "the run was not cancelled"
        time.sleep(0.01)
    took = time.monotonic() - asked

    assert took < 1.0, f"cancel took {took:.2f}s"
    assert stalled.disconnected.wait(1.0)  # the HTTP response was closed, not left hanging
    assert owner.idle(5)
    cancelled = other.get_run(run.id)
    assert cancelled.claim is None and cancelled.output is None
    # What the provider counted before the hang-up (message_start's usage) counts: the
    # run's usage said nothing of a call that was billed.
    assert cancelled.usage == Usage(input_tokens=1500, output_tokens=1, cache_read_input_tokens=700)
    assert owner.steps(run.id) == []
    assert len(fake.requests) == 1  # an abort is not retried
    assert errors == []


# --- prompt caching ---------------------------------------------------------------------


def test_second_request_marks_system_and_two_messages_for_caching_but_storage_stays_clean(
    make_engine: EngineFactory, fake: FakeAnthropic
) -> None:
    fake.push(
        reply(text("Searching."), tool_use("search_issues", {"query": "crash"}, id="toolu_1")),
        reply(text("Nothing similar.")),
    )
    engine = manual_engine(make_engine, triage_agent(fake))

    run = run_to_end(engine)

    assert run.status is RunStatus.COMPLETED, run.error
    first, second = fake.requests
    for sent in (first, second):
        assert sent.body["system"][-1]["cache_control"] == EPHEMERAL
    messages = second.messages
    assert messages[-1]["role"] == "user"
    assert messages[-1]["content"][-1]["type"] == "tool_result"
    assert messages[-1]["content"][-1]["cache_control"] == EPHEMERAL
    # The newest message, and the previous request's newest (where its cache entry is).
    assert cache_marks(messages) == 2 and cache_marks(messages[0]) == 1
    assert cache_marks(first.messages) == 1

    checkpoint = engine.checkpoint(run.id)
    assert checkpoint is not None
    assert cache_marks(checkpoint.messages) == 0
    assert cache_marks(engine.store.transcript(run.id).messages) == 0
    # What was sent is the stored transcript plus the marker, nothing else.
    assert without_cache_control(messages) == checkpoint.messages[:3]
