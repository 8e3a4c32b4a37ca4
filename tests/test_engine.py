"""One execution and the engine around it, on the real Postgres and Redis."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
import redis
import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, ValidationError

from agentruns import (
    Agent,
    Budget,
    Engine,
    FatalToolError,
    InvalidTriggerError,
    LeaseLostError,
    LocalLeases,
    RedisLeases,
    RunContext,
    RunError,
    RunNotFoundError,
    RunStatus,
    SqlStore,
    ToolContext,
    TriggerEnvelope,
    UnknownAgentError,
    Usage,
    tool,
    transcript,
)
from agentruns.errors import InvalidCheckpointError
from agentruns.events import Event
from agentruns.models import ScriptedModel, text, tool_use
from agentruns.models.base import ModelRequest, ModelResponse
from agentruns.recovery import held_back
from agentruns.runs import ERROR_MESSAGE_LENGTH, Run, utcnow
from agentruns.schedulers import ManualScheduler
from agentruns.store import schema
from agentruns.store.base import Claimed, Commit, Guard, NewStep
from tests.conftest import (
    REDIS_URL,
    EngineFactory,
    Errors,
    database_away,
    drop_connections,
    engines_on,
    trigger,
    wait_for,
)


@tool
def search_issues(query: str, limit: int = 5) -> list[dict[str, Any]]:
    """Search the tracker."""
    return [{"id": i, "title": f"{query} {i}"} for i in range(limit)]


def test_happy_run_appends_dense_steps_and_sums_usage(make_engine: EngineFactory) -> None:
    model = ScriptedModel(
        [tool_use("search_issues", {"query": "crash", "limit": 2}), text("Found two.")],
        usage=Usage(input_tokens=10, output_tokens=5),
    )
    agent = Agent("triage", model, instructions="Triage.", tools=[search_issues])
    engine = make_engine([agent])
    events: list[tuple[str, Any]] = []
    engine.on("run.updated", lambda e: events.append(("run", e.run.status if e.run else None)))
    engine.on("step.appended", lambda e: events.append(("step", e.step.kind if e.step else None)))

    run = engine.dispatch(
        "triage", trigger({"title": "App crashes"}, id="evt-1", keys={"repo": "acme/app"})
    )
    assert engine.idle(10)
    run = engine.get_run(run.id)

    assert run.status is RunStatus.COMPLETED
    assert run.output == "Found two."
    assert run.usage.input_tokens == 20 and run.usage.output_tokens == 10
    assert run.steps_used == 2
    assert run.claim is None and run.finished_at is not None
    steps = engine.steps(run.id)
    assert [(s.index, s.kind, s.name) for s in steps] == [
        (0, "llm", "scripted"),
        (1, "tool", "search_issues"),
        (2, "llm", "scripted"),
    ]
    assert steps[1].input == {"query": "crash", "limit": 2}
    assert steps[1].output == [{"id": 0, "title": "crash 0"}, {"id": 1, "title": "crash 1"}]

    first = model.calls[0][0]
    assert first["role"] == "user"
    assert json.loads(first["content"]) == {
        "source": "manual",
        "trigger": "manual",
        "payload": {"title": "App crashes"},
    }
    assert events == [
        ("run", RunStatus.QUEUED),
        ("run", RunStatus.RUNNING),
        ("step", "llm"),
        ("run", RunStatus.RUNNING),
        ("step", "tool"),
        ("run", RunStatus.RUNNING),
        ("step", "llm"),
        ("run", RunStatus.COMPLETED),
    ]
    checkpoint = engine.checkpoint(run.id)
    assert checkpoint is not None
    assert checkpoint.step_index == 1 and checkpoint.finish_reason == "end_turn"
    assert [m["role"] for m in checkpoint.messages] == ["user", "assistant", "user", "assistant"]


def test_the_first_message_renders_the_trigger_as_the_seed_does(
    make_engine: EngineFactory,
) -> None:
    # Its keys were sorted, the payload's too (payload came first), and text outside
    # ASCII escaped.
    model = ScriptedModel([text("ok")])
    engine = make_engine([Agent("a", model)])
    payload = {"title": "Ça plante", "labels": ["bug"], "body": "a\x00b"}
    engine.dispatch("a", trigger(payload, id="evt-1", keys={"repo": "acme/app"}))
    assert engine.idle(10)
    assert model.calls[0][0]["content"] == (
        "{\n"
        '  "source": "manual",\n'
        '  "trigger": "manual",\n'
        '  "payload": {\n'
        '    "title": "Ça plante",\n'
        '    "labels": [\n'
        '      "bug"\n'
        "    ],\n"
        '    "body": "a\\u0000b"\n'
        "  }\n"
        "}"
    )


def test_concurrent_dispatch_of_one_idempotency_key_makes_one_run(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(
        [Agent("triage", ScriptedModel([text("ok")]))], scheduler=ManualScheduler()
    )
    barrier = threading.Barrier(8)
    ids: list[str] = []

    def go() -> None:
        barrier.wait()
        ids.append(engine.dispatch("triage", trigger({"n": 1}, id="same")).id)

    threads = [threading.Thread(target=go) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ids) == 8 and len(set(ids)) == 1
    assert len(engine.list_runs()) == 1


def test_a_key_that_names_another_agents_run_returns_it_and_says_so(
    make_engine: EngineFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # One webhook event sent to two agents under its id (the default key) started
    # only the first agent's run, and nothing said so.
    engine = make_engine(
        [Agent(name, ScriptedModel([text("ok")])) for name in ("triage", "notify")],
        scheduler=ManualScheduler(),
    )
    first = engine.dispatch("triage", trigger({"n": 1}, id="evt-9"))
    with caplog.at_level("WARNING", logger="agentruns"):
        assert engine.dispatch("triage", trigger({"n": 1}, id="evt-9")).id == first.id
        tuples = trigger({"n": (1, 2)}, id="evt-10")  # stored as JSON: a list
        assert engine.dispatch("triage", tuples).id == engine.dispatch("triage", tuples).id
        assert caplog.records == []  # the same dispatch again: nothing to say
        assert engine.dispatch("notify", trigger({"n": 1}, id="evt-9")).id == first.id
        assert engine.dispatch("triage", trigger({"n": 2}, id="evt-9")).id == first.id
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all("'evt-9' already names run " + first.id in m for m in said)
    assert "of agent 'triage'" in said[0] and "of another payload" in said[1]
    assert len(engine.list_runs()) == 2


def test_dispatch_refuses_unknown_agent_and_non_json_payload_storing_nothing(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine([Agent("triage", ScriptedModel([text("ok")]))])
    with pytest.raises(UnknownAgentError):
        engine.dispatch("nobody", trigger({}))
    with pytest.raises(InvalidTriggerError):
        engine.dispatch("triage", trigger({"bad": {1, 2}}))
    with pytest.raises(InvalidTriggerError):
        engine.dispatch("triage", {"source": "manual"})
    with pytest.raises(InvalidTriggerError):
        engine.dispatch("triage", trigger(float("nan")))
    assert engine.list_runs() == []
    with pytest.raises(RunNotFoundError):
        engine.get_run("no-such-run")


def test_dispatch_refuses_what_no_store_can_keep_storing_nothing(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine([Agent("triage", ScriptedModel([text("ok")]))])
    nested: Any = []
    for _ in range(300):
        nested = [nested]
    lone = "\ud800"  # a lone surrogate, as undecodable bytes become: not UTF-8
    bad_triggers = [
        trigger(lone),
        trigger(nested),
        {"source": lone, "trigger": "t"},
        {"source": "s", "trigger": "t", "keys": {"k": lone}},
    ]
    # An envelope is checked again on dispatch: it may have changed since it was made.
    changed = TriggerEnvelope(source="s", trigger="t", payload={"a": []})
    changed.payload["a"].append({1, 2})
    bad_triggers += [changed, TriggerEnvelope.model_construct(source="s", payload={1})]
    for bad in bad_triggers:
        with pytest.raises(InvalidTriggerError):
            engine.dispatch("triage", bad)
    for name in ("idempotency_key", "concurrency_key", "thread"):
        with pytest.raises(InvalidTriggerError, match=name):
            engine.dispatch("triage", trigger({}), **{name: lone})
    # Keys longer than the store keeps; a thread's name is also "thread:<name>".
    too_long = [{"idempotency_key": "k" * 501}, {"concurrency_key": "k" * 501}]
    too_long += [{"thread": "t" * 494}, {"thread": "t" * 494, "concurrency_key": "own"}]
    for fields in too_long:
        with pytest.raises(InvalidTriggerError, match=next(iter(fields))):
            engine.dispatch("triage", trigger({}), **fields)
    with pytest.raises(InvalidTriggerError, match="idempotency_key"):
        engine.dispatch("triage", trigger({}, id="i" * 501))
    # NUL: Postgres text cannot hold it (libpq cut "order\x00A" to "order").
    for name in ("idempotency_key", "concurrency_key", "thread"):
        with pytest.raises(InvalidTriggerError, match=f"{name} must not hold a NUL"):
            engine.dispatch("triage", trigger({}), **{name: "order\x00A"})
    with pytest.raises(InvalidTriggerError, match="NUL"):
        engine.dispatch("triage", trigger({}, id="order\x00A"))
    # Empty: an unset variable, most likely, which would make all runs one (or one line).
    for name in ("idempotency_key", "concurrency_key", "thread"):
        with pytest.raises(InvalidTriggerError, match=f"{name} must not be empty"):
            engine.dispatch("triage", trigger({}), **{name: ""})
    # Named as given: an empty id was called an empty idempotency_key, never passed.
    for fields, named in (({"id": ""}, "the trigger's id"), ({"thread": ""}, "thread")):
        with pytest.raises(InvalidTriggerError, match=f"^{named}.* must not be empty"):
            engine.dispatch("triage", trigger({}, **fields))
    # A run of no source, or of no trigger name, was stored (shown as "/ manual").
    for field, named in (("source", "source"), ("trigger", r"name \(trigger\)")):
        with pytest.raises(InvalidTriggerError, match=f"^the trigger's {named} must not be empty"):
            engine.dispatch("triage", {**trigger({}), field: ""})
    assert engine.list_runs() == []
    assert engine.list_runs(agent=lone) == []
    for call in (engine.get_run, engine.steps, engine.checkpoint, engine.cancel, engine.execute):
        with pytest.raises(RunNotFoundError):
            call(lone)
    for limit in (0, -1, 10**20, True):
        with pytest.raises(ValueError, match="limit must be"):
            engine.list_runs(limit=limit)
    fine: Any = []
    for _ in range(200):
        fine = [fine]
    assert engine.dispatch("triage", trigger(fine)).trigger.payload == fine


def test_a_run_id_or_agent_name_holding_a_nul_is_not_found_on_either_store(
    make_any_engine: EngineFactory,
) -> None:
    # On Postgres, which cannot hold NUL in text, the reads raised a DataError and
    # execute() a ValueError; SQLite said the run was not found.
    engine = make_any_engine([Agent("a", ScriptedModel([text("ok")]))])
    run = engine.dispatch("a", trigger({}))
    assert engine.idle(10)
    reads = (engine.get_run, engine.steps, engine.checkpoint, engine.cancel, engine.execute)
    for call in (*reads, engine.approval_token):
        for run_id in ("a\x00b", run.id + "\x00"):
            with pytest.raises(RunNotFoundError):
                call(run_id)
    assert engine.list_runs(agent="a\x00") == []
    assert [r.id for r in engine.list_runs(agent="a")] == [run.id]
    # Not a name at all: "argument of type 'int' is not iterable".
    with pytest.raises(TypeError, match="agent must be an agent's name"):
        engine.list_runs(agent=5)


def _run_to_end(engine: Any, agent: str = "a", **kwargs: Any) -> Any:
    run = engine.dispatch(agent, trigger({}), **kwargs)
    assert engine.idle(10)
    return engine.get_run(run.id)


def test_the_agents_own_code_failing_fails_the_run_once(
    make_engine: EngineFactory, errors: Errors
) -> None:
    # An OSError from the agent's instructions (a prompt file gone) was taken for
    # an outage: the run stayed running, and every recover() ran it into the same
    # error. A message quoting undecodable bytes could not even be stored.
    def prompt(ctx: RunContext) -> str:
        raise FileNotFoundError(2, "No such file or directory", "prompts/triage.txt")

    def tools(ctx: RunContext) -> list[Any]:
        raise ValueError("no tools for " + os.fsdecode(b"caf\xe9.txt"))

    model = ScriptedModel([text("never")])
    engine = make_engine(
        [Agent("a", model, instructions=prompt), Agent("b", model, tools=tools)],
        requeue_after=0.1,
    )
    for agent, said in (
        ("a", "instructions: FileNotFoundError: [Errno 2] No such file or directory"),
        ("b", "tools: ValueError: no tools for caf\\udce9.txt"),
    ):
        run = _run_to_end(engine, agent)
        assert run.status is RunStatus.FAILED, run
        assert run.error is not None and run.error.code == "internal_error"
        assert run.error.message.startswith(said), run.error.message
        assert run.claim is None
    assert engine.recover() == []
    assert model.calls == []
    assert [type(e) for e in errors] == [FileNotFoundError, ValueError]


def test_a_tool_error_quoting_undecodable_bytes_goes_to_the_model(
    make_engine: EngineFactory,
) -> None:
    # It failed the whole run with internal_error (UnicodeEncodeError).
    @tool
    def open_file() -> str:
        """Open the file."""
        raise ValueError("unsupported file type: " + os.fsdecode(b"r\xe9sum\xe9.doc"))

    model = ScriptedModel([tool_use("open_file", {}), text("Could not open it.")])
    run = _run_to_end(make_engine([Agent("a", model, tools=[open_file])]))
    assert run.status is RunStatus.COMPLETED, run.error
    result = model.calls[1][-1]["content"][0]
    assert result["is_error"] is True
    assert result["content"] == "ValueError: unsupported file type: r\\udce9sum\\udce9.doc"


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("cannot say")


class _Unsaying(Exception):
    def __str__(self) -> Any:
        return 5  # str() then raises TypeError


class _UnprintableFatal(FatalToolError):
    def __str__(self) -> str:
        raise RuntimeError("cannot say")


def test_a_tool_exception_that_cannot_say_what_it_is_is_still_a_tool_error(
    make_engine: EngineFactory,
) -> None:
    # Formatting it raised again: the whole run failed internal_error, and an effect
    # tool's intent was left without its result.
    @tool
    def plain() -> str:
        """Plain."""
        raise _Unsaying()

    @tool(effect=True)
    def pay() -> str:
        """Pay."""
        raise _Unprintable()

    def ask(arguments: dict[str, Any], ctx: ToolContext) -> bool:
        raise _Unprintable()

    @tool(needs_approval=ask)
    def gated() -> str:
        """Gated."""
        return "never"

    model = ScriptedModel(
        [[tool_use("plain", {}), tool_use("pay", {}), tool_use("gated", {})], text("ok")]
    )
    engine = make_engine([Agent("a", model, tools=[plain, pay, gated])])
    run = _run_to_end(engine)
    assert run.status is RunStatus.COMPLETED, run.error
    results = model.calls[1][-1]["content"]
    assert [(r["content"], r["is_error"]) for r in results] == [
        ("<unprintable _Unsaying>", True),
        ("<unprintable _Unprintable>", True),
        ("<unprintable _Unprintable>", True),
    ]
    (effect,) = engine.store.effects(run.id).values()
    assert effect.done and effect.is_error and effect.result == "<unprintable _Unprintable>"


def test_agent_code_that_cannot_say_what_it_raised_fails_the_run_with_its_own_code(
    make_engine: EngineFactory,
) -> None:
    @tool
    def explode() -> str:
        """Explode."""
        raise _UnprintableFatal()

    class Broken:
        name = "broken"

        def complete(self, request: Any, signal: threading.Event) -> Any:
            raise _Unprintable()

    def prompt(ctx: RunContext) -> str:
        raise _Unprintable()

    engine = make_engine(
        [
            Agent("fatal", ScriptedModel([tool_use("explode", {})]), tools=[explode]),
            Agent("model", Broken()),  # type: ignore[arg-type]
            Agent("prompt", ScriptedModel([text("never")]), instructions=prompt),
        ]
    )
    for agent, code, message in (
        ("fatal", "fatal_tool_error", "explode: <unprintable _UnprintableFatal>"),
        ("model", "model_error", "<unprintable _Unprintable>"),
        ("prompt", "internal_error", "instructions: <unprintable _Unprintable>"),
    ):
        run = _run_to_end(engine, agent)
        assert run.status is RunStatus.FAILED
        assert run.error is not None and (run.error.code, run.error.message) == (code, message)


def test_a_tool_that_exits_in_a_pool_thread_is_a_tool_error(make_engine: EngineFactory) -> None:
    # argparse exits on bad arguments. Raised on in an execution's thread (Celery's
    # threads pool, LocalScheduler), it ended the thread's task unfinished: the run
    # stayed running, and every recovery called the tool again.
    @tool
    def parse(argv: str) -> str:
        """Parse a command line."""
        parser = argparse.ArgumentParser(prog="report")
        parser.add_argument("--days", type=int, required=True)
        return str(parser.parse_args(argv.split()).days)

    @tool
    def interrupt() -> str:
        """Interrupt."""
        raise KeyboardInterrupt

    def ask_unless_quiet(arguments: dict[str, Any], ctx: ToolContext) -> bool:
        raise SystemExit("quit")

    @tool(needs_approval=ask_unless_quiet)
    def gated() -> str:
        """Gated."""
        return "never"

    model = ScriptedModel(
        [
            tool_use("parse", {"argv": "--days many"}),
            tool_use("interrupt", {}),
            tool_use("gated", {}),
            text("ok"),
        ]
    )
    run = _run_to_end(make_engine([Agent("a", model, tools=[parse, interrupt, gated])]))
    assert run.status is RunStatus.COMPLETED, run
    results = [c[-1]["content"][0]["content"] for c in model.calls[1:]]
    assert results == ["SystemExit: 2", "KeyboardInterrupt: ", "SystemExit: quit"]


def test_calls_that_would_wait_for_their_own_execution_do_not(make_engine: EngineFactory) -> None:
    # From a tool, idle() and close() waited for the execution they were called in,
    # forever; drain() without a timeout too. A listener's execute() of another run
    # with every slot taken (by its own execution) waited for a slot forever.
    engine: Engine
    said: list[str] = []

    @tool
    def wait_for_quiet() -> str:
        """Wait until nothing runs."""
        for call in (engine.idle, engine.close):
            try:
                call()
            except RuntimeError as exc:
                said.append(str(exc))
        engine.drain()
        return "drained"

    model = ScriptedModel([tool_use("wait_for_quiet", {}), text("never")])
    engine = make_engine(
        [Agent("a", model, tools=[wait_for_quiet]), Agent("b", ScriptedModel([text("b")]))],
        slots=1,
        scheduler=ManualScheduler(),
    )
    follow_up = engine.dispatch("b", trigger({}))
    executed: list[Run] = []

    def chain(event: Any) -> None:
        run = event.run
        if run.agent == "a" and run.status is RunStatus.RUNNING and not executed:
            executed.append(engine.execute(follow_up.id))

    engine.on("run.updated", chain)
    run = engine.execute(engine.dispatch("a", trigger({})).id)
    assert [r.status for r in executed] == [RunStatus.COMPLETED]
    assert run.status is RunStatus.INTERRUPTED  # drained, once its tool returned
    assert said == [
        f"{call} cannot be called from inside one of this engine's executions (a tool, "
        "listener or notifier): it would wait for that execution, which waits for it"
        for call in ("idle()", "close()")
    ]
    assert [s.output for s in engine.steps(run.id) if s.kind == "tool"] == ["drained"]


def test_a_deeply_nested_tool_input_reaches_the_tool(make_engine: EngineFactory) -> None:
    # Copied with deepcopy (which recurses in Python), an input 250 levels deep
    # failed the run with a RecursionError; the store had taken it. (254 levels is
    # as deep as a reply may nest an input.)
    seen: list[int] = []

    @tool
    def walk(tree: dict[str, Any]) -> str:
        """Walk the tree."""
        depth = 0
        while tree.get("x"):
            tree, depth = tree["x"][0], depth + 1
        seen.append(depth)
        return str(depth)

    tree: dict[str, Any] = {}
    for _ in range(126):
        tree = {"x": [tree]}
    model = ScriptedModel([tool_use("walk", {"tree": tree}), text("ok")])
    run = _run_to_end(make_engine([Agent("a", model, tools=[walk])]))
    assert run.status is RunStatus.COMPLETED, run.error
    assert seen == [126]


def test_a_tool_changing_its_input_changes_no_record_of_the_call(
    make_engine: EngineFactory,
) -> None:
    @tool
    def tidy(data: dict[str, Any]) -> str:
        """Tidy the data."""
        data["inner"]["list"].append(99)
        data["inner"]["secret"] = "changed"
        return "tidied"

    asked = {"data": {"inner": {"secret": "as asked", "list": [1]}}}
    model = ScriptedModel([tool_use("tidy", asked), text("ok")])
    engine = make_engine([Agent("a", model, tools=[tidy])])
    run = _run_to_end(engine)
    (step,) = [s for s in engine.steps(run.id) if s.kind == "tool"]
    assert step.input == asked
    assert model.calls[1][-2]["content"][-1]["input"] == asked  # the model's next request
    stored = engine.checkpoint(run.id)
    assert stored is not None and stored.messages[1]["content"][-1]["input"] == asked


def test_a_write_larger_than_postgres_takes_fails_the_run_once(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Over 1 GiB in one statement, Postgres dropped the connection; taken for an
    # outage, the run stayed running and every recover() called the tool again.
    # (The limit is lowered here: a real one would take gigabytes of memory.)
    monkeypatch.setattr("agentruns.store.postgres.MOST_BYTES", 100_000)
    calls: list[int] = []

    @tool
    def export() -> str:
        """Export everything."""
        calls.append(1)
        return "x" * 200_000

    model = ScriptedModel([tool_use("export", {}), text("never")])
    engine = make_engine([Agent("a", model, tools=[export])], requeue_after=0.1)
    run = _run_to_end(engine)
    assert run.status is RunStatus.FAILED and run.error is not None
    assert run.error.code == "internal_error"
    assert "more than Postgres takes in one statement" in run.error.message
    assert engine.recover() == [] and calls == [1]


class _Interrupted(BaseException):
    pass


@pytest.mark.parametrize(
    "raised", [SystemExit(2), KeyboardInterrupt(), GeneratorExit(), _Interrupted("odd")], ids=repr
)
def test_the_agents_own_code_or_model_raising_a_base_exception_fails_the_run(
    make_engine: EngineFactory, errors: Errors, raised: BaseException
) -> None:
    # SystemExit from argparse (say) in the instructions, the tools callable or the
    # model, in an execution's thread: the execution ended with the run left running
    # and a traceback, and every recover() requeued it into the same, counted as lost
    # with its worker. A tool raising it already gave the model a tool error.
    def prompt(ctx: RunContext) -> str:
        raise raised

    def tools(ctx: RunContext) -> list[Any]:
        raise raised

    class Raising(ScriptedModel):
        def complete(self, request: ModelRequest, signal: threading.Event) -> ModelResponse:
            raise raised

    engine = make_engine(
        [
            Agent("a", ScriptedModel([text("never")]), instructions=prompt),
            Agent("b", ScriptedModel([text("never")]), tools=tools),
            Agent("c", Raising([text("never")])),
        ],
        requeue_after=0.1,
    )
    for agent, code, said in (
        ("a", "internal_error", f"instructions: {type(raised).__name__}"),
        ("b", "internal_error", f"tools: {type(raised).__name__}"),
        ("c", "model_error", type(raised).__name__),
    ):
        run = _run_to_end(engine, agent)
        assert run.status is RunStatus.FAILED, run
        assert run.error is not None and run.error.code == code, run.error
        assert run.error.message.startswith(said), run.error.message
        assert run.claim is None
    assert engine.recover() == []
    assert len(errors) == 2 and all(isinstance(e, Exception) for e in errors)


def test_a_reply_no_store_can_keep_fails_as_the_models_error(make_engine: EngineFactory) -> None:
    # It failed internal_error with its tokens lost. An unknown tool's name longer
    # than the step row's column failed the run on Postgres, not the call.
    usage = Usage(input_tokens=10, output_tokens=5)
    replies = {"surrogate": [text("caf\udce9")]}
    agents = [
        Agent(name, ScriptedModel(script, usage=usage), tools=[search_issues])
        for name, script in replies.items()
    ]
    long_name = ScriptedModel([tool_use("x" * 300, {}), text("ok")])
    engine = make_engine([*agents, Agent("long", long_name, tools=[search_issues])])
    for name in replies:
        run = _run_to_end(engine, name)
        assert run.status is RunStatus.FAILED, run
        assert run.error is not None and run.error.code == "model_error", run.error
        assert run.error.message.startswith("malformed model reply: it cannot be stored")
        assert run.usage.total_tokens == 15
    run = _run_to_end(engine, "long")
    assert run.status is RunStatus.COMPLETED, run.error
    (step,) = [s for s in engine.steps(run.id) if s.kind == "tool"]
    assert step.name == "x" * 200 and step.error["code"] == "unknown_tool"  # type: ignore[index]


def test_step_budget_fails_the_run_with_its_code(make_engine: EngineFactory) -> None:
    model = ScriptedModel([tool_use("search_issues", {"query": "x"})])  # never answers
    engine = make_engine([Agent("a", model, tools=[search_issues], budget=Budget(max_steps=3))])
    run = _run_to_end(engine)
    assert run.status is RunStatus.FAILED
    assert run.error is not None and run.error.code == "step_budget_exceeded"
    assert run.steps_used == 3 and len(model.calls) == 3


def test_token_budget_fails_the_run_with_its_code(make_engine: EngineFactory) -> None:
    model = ScriptedModel(
        [tool_use("search_issues", {"query": "x"})], usage=Usage(input_tokens=60, output_tokens=0)
    )
    agent = Agent("a", model, tools=[search_issues], budget=Budget(max_tokens=100))
    run = _run_to_end(make_engine([agent]))
    assert run.status is RunStatus.FAILED
    assert run.error is not None and run.error.code == "token_budget_exceeded"
    assert run.usage.input_tokens == 120


def test_timeout_fails_the_execution_with_its_code(make_engine: EngineFactory) -> None:
    model = ScriptedModel([text("late")], latency_s=5.0)
    agent = Agent("a", model, budget=Budget(timeout_s=0.3))
    started = time.monotonic()
    run = _run_to_end(make_engine([agent]))
    assert time.monotonic() - started < 3
    assert run.status is RunStatus.FAILED
    assert run.error is not None and run.error.code == "timeout"


def test_dispatch_budget_overrides_the_agents(make_engine: EngineFactory) -> None:
    model = ScriptedModel([tool_use("search_issues", {"query": "x"})])
    engine = make_engine([Agent("a", model, tools=[search_issues])])
    run = _run_to_end(engine, budget=Budget(max_steps=2))
    assert run.error is not None and run.error.code == "step_budget_exceeded"
    assert run.steps_used == 2


def test_a_budget_without_a_finite_timeout_is_refused_storing_nothing(
    make_engine: EngineFactory,
) -> None:
    # An infinite timeout passed as a limit, then Postgres refused its JSON with a
    # raw DataError.
    engine = make_engine([Agent("a", ScriptedModel([text("hi")]))])
    with pytest.raises(InvalidTriggerError, match="timeout_s"):
        engine.dispatch("a", trigger({}), budget={"timeout_s": float("inf")})
    with pytest.raises(ValidationError):
        Budget(timeout_s=float("inf"))
    assert engine.list_runs() == []


def test_a_dispatch_budget_replaces_only_the_limits_it_names(make_engine: EngineFactory) -> None:
    limits = Budget(max_steps=3, max_tokens=1000, timeout_s=0.5)
    slow = Agent("slow", ScriptedModel([text("late")], latency_s=5.0), budget=limits)
    looping = ScriptedModel([tool_use("search_issues", {"query": "x"})])
    busy = Agent("busy", looping, tools=[search_issues], budget=limits)
    engine = make_engine([slow, busy])
    # Naming max_steps keeps the agent's timeout (a full default Budget had none).
    run = engine.dispatch("slow", trigger({}), budget={"max_steps": 5})
    assert run.budget == Budget(max_steps=5, max_tokens=1000, timeout_s=0.5)
    assert engine.idle(10)
    run = engine.get_run(run.id)
    assert run.error is not None and run.error.code == "timeout"
    # Naming max_tokens keeps the agent's 3 steps (not the default 25).
    run = engine.dispatch("busy", trigger({}), budget=Budget(max_tokens=5000))
    assert engine.idle(10)
    run = engine.get_run(run.id)
    assert run.error is not None and run.error.code == "step_budget_exceeded"
    assert run.steps_used == 3
    # A limit named as None is lifted.
    run = engine.dispatch("slow", trigger({}), budget={"timeout_s": None})
    assert run.budget == Budget(max_steps=3, max_tokens=1000, timeout_s=None)
    engine.cancel(run.id)


def test_a_nul_in_the_payload_and_the_answer_is_kept_in_the_transcript(
    make_engine: EngineFactory,
) -> None:
    model = ScriptedModel([tool_use("search_issues", {"query": "a\x00b"}), text("x\x00y")])
    engine = make_engine([Agent("a", model, tools=[search_issues])])
    run = engine.get_run(engine.dispatch("a", trigger({"q": "a\x00b"})).id)
    assert engine.idle(10)
    run = engine.get_run(run.id)
    assert run.status is RunStatus.COMPLETED
    assert run.output == "x\ufffdy"  # a text column cannot hold NUL; the transcript does
    checkpoint = engine.checkpoint(run.id)
    assert checkpoint is not None
    assert checkpoint.messages[-1]["content"][0]["text"] == "x\x00y"
    assert json.loads(checkpoint.messages[0]["content"])["payload"] == {"q": "a\x00b"}


def test_a_payloads_keys_that_are_not_text_are_spelled_as_json_spells_them(
    make_any_engine: EngineFactory,
) -> None:
    # Stored as pydantic spells them ({None: 1} as {"None": 1}), and shown to the
    # model as JSON does ({"null": 1}); through a Celery message, as JSON does.
    model = ScriptedModel([text("ok")])
    engine = make_any_engine([Agent("a", model)])
    payload = {1: "a", None: 2, False: 3, 1.5: 4, "x": [{2: ({None: 0},)}]}
    spelled = {"1": "a", "null": 2, "false": 3, "1.5": 4, "x": [{"2": [{"null": 0}]}]}
    run = engine.dispatch("a", trigger(payload))
    assert run.trigger.payload == spelled
    assert engine.idle(10)
    assert engine.get_run(run.id).trigger.payload == spelled
    checkpoint = engine.checkpoint(run.id)
    assert checkpoint is not None
    assert json.loads(checkpoint.messages[0]["content"])["payload"] == spelled
    # Two keys JSON spells alike: one would be lost (JSON keeps the last).
    for both in ({1: "a", "1": "b"}, {"x": [{None: 1, "null": 2}]}):
        with pytest.raises(
            InvalidTriggerError, match=r"the keys (1 and '1'|None and 'null') of a dict are both"
        ):
            engine.dispatch("a", trigger(both))
    assert len(engine.list_runs()) == 1


def test_fatal_tool_error_fails_the_run(make_engine: EngineFactory) -> None:
    @tool
    def explode() -> str:
        """Fail hard."""
        raise FatalToolError("the tracker is gone")

    agent = Agent("a", ScriptedModel([tool_use("explode"), text("never")]), tools=[explode])
    run = _run_to_end(make_engine([agent]))
    assert run.status is RunStatus.FAILED
    assert run.error is not None and run.error.code == "fatal_tool_error"
    assert "the tracker is gone" in run.error.message


def test_a_huge_error_is_kept_shortened_and_says_how_much_more_there_was(
    make_engine: EngineFactory,
) -> None:
    # What caused it was stored whole: a 2 MB exception text in the run's row, its
    # log line and every `agentruns show`.
    @tool
    def explode() -> str:
        """Fail hard."""
        raise FatalToolError("gone " * 400_000)

    agent = Agent("a", ScriptedModel([tool_use("explode"), text("never")]), tools=[explode])
    engine = make_engine([agent])
    run = _run_to_end(engine)
    assert run.error is not None and run.error.code == "fatal_tool_error"
    assert run.error.message.startswith("explode: gone gone")
    kept = ERROR_MESSAGE_LENGTH - 40
    assert run.error.message.endswith(f"… ({2_000_009 - kept} more characters)")
    assert len(run.error.message) <= ERROR_MESSAGE_LENGTH
    step = engine.steps(run.id)[-1]
    assert step.error is not None and step.error["message"].endswith(" more characters)")
    # Lone surrogates are escaped (6 characters each) before it is shortened: stored,
    # it was 18,018 characters, and each read shortened it again.
    escaped = RunError(code="x", message="cannot open " + "\udc80" * 3000).message
    assert len(escaped) <= ERROR_MESSAGE_LENGTH and escaped.startswith("cannot open \\udc80")
    assert RunError(code="x", message=escaped).message == escaped


def test_tool_errors_invalid_arguments_and_unknown_tools_reach_the_model(
    make_engine: EngineFactory,
) -> None:
    @tool
    def flaky(n: int) -> int:
        """Fails for odd numbers."""
        if n % 2:
            raise ValueError("odd")
        return n

    model = ScriptedModel(
        [
            [
                tool_use("flaky", {"n": 1}),
                tool_use("flaky", {"n": "not a number"}),
                tool_use("nope", {}),
                tool_use("flaky", {"n": 2}),
            ],
            text("Handled."),
        ]
    )
    engine = make_engine([Agent("a", model, tools=[flaky])])
    run = _run_to_end(engine)
    assert run.status is RunStatus.COMPLETED
    results = model.calls[1][-1]["content"]
    assert [r.get("is_error", False) for r in results] == [True, True, True, False]
    assert "ValueError: odd" in results[0]["content"]
    assert "invalid arguments for flaky" in results[1]["content"]
    assert "unknown tool 'nope'" in results[2]["content"]
    assert results[3]["content"] == "2"
    tool_steps = [s for s in engine.steps(run.id) if s.kind == "tool"]
    assert [s.error["code"] if s.error else None for s in tool_steps] == [
        "tool_error",
        "invalid_input",
        "unknown_tool",
        None,
    ]


def test_malformed_model_reply_fails_with_model_error_keeping_the_transcript(
    make_engine: EngineFactory,
) -> None:
    malformed = [
        {"type": "tool_use", "name": "x", "id": "t"},  # no input
        {"type": "text", "text": 123},
        {"type": "text"},
        {"type": "tool_use", "name": "a\x00b", "id": "t", "input": {}},  # no store keeps it
        # No content: stored, the provider would refuse the transcript once anything
        # followed it (the next run of a thread).
        [],
        text(""),
        [text(" \n"), text("")],
        # No answer: the run would complete with nothing as its output.
        {"type": "thinking", "thinking": "Hmm.", "signature": "s"},
        [{"type": "thinking", "thinking": "Hmm.", "signature": "s"}, text(" ")],
        # A user's content: the transcript would be refused once anything followed it.
        {"type": "tool_result", "tool_use_id": "t", "content": "x"},
        [text("See:"), {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}],
    ]
    for reply in malformed:
        model = ScriptedModel(
            [tool_use("search_issues", {"query": "x"}), reply],
            usage=Usage(input_tokens=10, output_tokens=5),
        )
        engine = make_engine([Agent("a", model, tools=[search_issues])])
        run = _run_to_end(engine)
        assert run.status is RunStatus.FAILED, reply
        assert run.error is not None and run.error.code == "model_error", run.error
        checkpoint = engine.checkpoint(run.id)
        assert checkpoint is not None and len(checkpoint.messages) == 3
        # The refused reply's tokens were spent all the same.
        assert run.usage == Usage(input_tokens=20, output_tokens=10), reply


def _nested(levels: int) -> Any:
    value: Any = "bottom"
    for _ in range(levels - 1):
        value = [value]
    return {"x": value}


@pytest.mark.parametrize("levels", [255, 975, 3_000])
def test_a_tool_input_nested_deeper_than_a_payload_may_be_is_a_malformed_reply(
    make_engine: EngineFactory, levels: int
) -> None:
    # Stored, it failed every read of its step (`agentruns show` too), a pause for
    # its approval (internal_error) and, from ~975 levels, every next run of its thread.
    @tool(needs_approval=True)
    def post(x: Any) -> str:
        """Post it."""
        return "posted"

    model = ScriptedModel(
        [tool_use("search_issues", {"query": "x"}), tool_use("post", _nested(levels))],
        usage=Usage(input_tokens=10, output_tokens=5),
    )
    engine = make_engine([Agent("a", model, tools=[search_issues, post])])
    with pytest.raises(InvalidTriggerError):  # the bound a trigger's payload is held to
        engine.dispatch("a", trigger(_nested(levels)))
    run = _run_to_end(engine)
    assert run.status is RunStatus.FAILED
    assert run.error is not None and run.error.code == "model_error", run.error
    assert run.error.message.startswith(
        "malformed model reply: it cannot be stored (the input of a tool_use block"
    )
    assert run.usage == Usage(input_tokens=20, output_tokens=10)
    checkpoint = engine.checkpoint(run.id)
    assert checkpoint is not None and len(checkpoint.messages) == 3  # nothing of the reply
    assert [s.kind for s in engine.steps(run.id)] == ["llm", "tool"]


def test_a_tool_input_as_deep_as_a_payload_may_be_is_stored_read_and_approved(
    make_engine: EngineFactory,
) -> None:
    @tool(needs_approval=True)
    def post(x: Any) -> str:
        """Post it."""
        return "posted"

    deepest = _nested(254)
    model = ScriptedModel([tool_use("post", deepest), text("Posted.")])
    engine = make_engine([Agent("a", model, tools=[post])])
    assert engine.dispatch("a", trigger(deepest)).trigger.payload == deepest
    run = _run_to_end(engine)
    assert run.status is RunStatus.WAITING, run.error
    assert run.waiting is not None and run.waiting.input == deepest
    engine.resume(engine.approval_token(run.id), approved=True)
    assert engine.idle(10)
    assert engine.get_run(run.id).status is RunStatus.COMPLETED
    for step in engine.steps(run.id):  # what `agentruns show --json` prints
        step.model_dump_json()


def test_a_tool_call_id_no_store_can_key_an_effect_by_is_a_malformed_reply_on_both(
    make_any_engine: EngineFactory,
) -> None:
    # An effect's record is keyed by the call's id (200 characters, no NUL): on
    # Postgres the run failed internal_error, while SQLite took it.
    calls: list[str] = []

    @tool(effect=True)
    def pay() -> str:
        """Pay."""
        calls.append("pay")
        return "paid"

    @tool
    def look() -> str:
        """Look."""
        calls.append("look")
        return "seen"

    engine = make_any_engine([])
    for name in ("pay", "look"):
        for call_id, fine in (("i" * 200, True), ("i" * 201, False), ("a\x00b", False)):
            calls.clear()
            model = ScriptedModel([tool_use(name, {}, id=call_id), text("done")])
            engine.register(Agent(f"{name}-{len(call_id)}", model, tools=[pay, look]))
            run = _run_to_end(engine, f"{name}-{len(call_id)}")
            if fine:
                assert run.status is RunStatus.COMPLETED, run.error
                assert calls == [name]
                continue
            assert run.status is RunStatus.FAILED, run
            assert run.error is not None and run.error.code == "model_error", run.error
            assert run.error.message.startswith("malformed model reply: a tool_use id")
            assert calls == [] and engine.steps(run.id) == []
            assert engine.checkpoint(run.id) is None  # nothing of the reply was written


def test_a_reply_calling_with_an_earlier_calls_id_gets_an_id_of_its_own_on_both(
    make_any_engine: EngineFactory,
) -> None:
    # A gateway that numbers calls per reply (call_1, every time): the effect's record
    # is kept by the call's id, so the second post was not made and the model was told
    # the first one's result for it; and the provider refuses such a transcript.
    posted: list[str] = []

    @tool(effect=True)
    def post(body: str) -> str:
        """Post it."""
        posted.append(body)
        return f"posted {body}"

    first = tool_use("post", {"body": "first"}, id="call_1")
    model = ScriptedModel([first, tool_use("post", {"body": "second"}, id="call_1"), text("done")])

    def again(messages: list[dict[str, Any]]) -> Any:  # each run of a thread: the same id
        last = messages[-1]["content"]
        answered = isinstance(last, list) and last[0].get("type") == "tool_result"
        return text("done") if answered else first

    engine = make_any_engine(
        [Agent("a", model, tools=[post]), Agent("b", ScriptedModel(again), tools=[post])]
    )

    def ids(run_id: str) -> list[str]:
        messages = engine.checkpoint(run_id).messages  # type: ignore[union-attr]
        return [c["id"] for m in messages for c in transcript.tool_calls(m)]

    run = _run_to_end(engine, "a")
    assert run.status is RunStatus.COMPLETED, run.error
    assert posted == ["first", "second"]
    # Ids the API takes (letters, digits, "_" and "-"): "call_1~2" was refused with a 400.
    assert ids(run.id) == ["call_1", "call_1-2"]
    transcript.validate(engine.checkpoint(run.id).messages)  # type: ignore[union-attr]
    # Across a thread's runs: the transcript the model is given holds them all.
    for _ in range(3):
        done = engine.dispatch("b", trigger({}), thread="t")
        assert engine.idle(10) and engine.get_run(done.id).status is RunStatus.COMPLETED
    assert ids(done.id) == ["call_1", "call_1-2", "call_1-3"]
    assert all(re.fullmatch(r"[a-zA-Z0-9_-]+", i) for i in ids(done.id))
    assert posted == ["first", "second", "first", "first", "first"]


def test_a_stored_transcript_repeating_a_call_id_is_taken_as_it_is() -> None:
    # An older release stored such replies: its threads go on.
    call = tool_use("post", {}, id="c")
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c"}]}
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": [call]}]
    assert transcript.validate([*messages, result, messages[1]]) == {"c"}


def test_a_reply_one_store_would_refuse_is_a_malformed_reply_on_both(
    make_any_engine: EngineFactory,
) -> None:
    # Postgres refused NaN in JSON, token counts past a bigint, a NUL in the model's
    # name and a stop_reason longer than 64 characters (internal_error, the tools of
    # a step already called); SQLite kept what it could.
    usage = Usage(input_tokens=10, output_tokens=5)

    def reply(**fields: Any) -> ModelResponse:
        return ModelResponse(**{"content": [text("ok")], "stop_reason": "end_turn", **fields})

    # With what the run counts once it is refused: the reply's tokens too, unless
    # they are what is wrong with it.
    replies: list[tuple[Any, Usage]] = [
        (tool_use("search_issues", {"query": "x", "limit": float("nan")}), usage + usage),
        ([{"type": "weird", "data": [float("inf")]}, text("ok")], usage + usage),
        (reply(model="m\x00", usage=usage), usage + usage),
        (reply(stop_reason="end\x00turn", usage=usage), usage + usage),
        (reply(stop_reason="x" * 65, usage=usage), usage + usage),  # its checkpoint's column
        (reply(usage=Usage(input_tokens=2**70)), usage),
        (reply(usage=Usage(output_tokens=-5)), usage),
    ]
    engine = make_any_engine([])
    for i, (bad, counted) in enumerate(replies):
        model = ScriptedModel([tool_use("search_issues", {"query": "x"}), bad], usage=usage)
        engine.register(Agent(f"a{i}", model, tools=[search_issues]))
        run = _run_to_end(engine, f"a{i}")
        assert run.status is RunStatus.FAILED, bad
        assert run.error is not None and run.error.code == "model_error", run.error
        assert run.error.message.startswith("malformed model reply: "), run.error
        checkpoint = engine.checkpoint(run.id)
        assert checkpoint is not None and len(checkpoint.messages) == 3
        assert run.usage == counted, bad


def test_counters_edited_below_the_stored_rows_fail_the_run_as_an_invalid_checkpoint(
    make_any_engine: EngineFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # A run whose message count was set below its stored messages continued from the
    # shorter transcript, and its next write collided with the rows past it: the run
    # failed internal_error, its message the whole SQL statement.
    @tool(needs_approval=True)
    def publish(text: str) -> str:
        """Publish."""
        return "published"

    script = [tool_use("search_issues", {"query": "x"}), tool_use("publish", {"text": "t"})]
    agent = Agent("a", ScriptedModel([*script, text("ok")]), tools=[search_issues, publish])
    engine = make_any_engine([agent])
    run = _run_to_end(engine)
    assert run.status is RunStatus.WAITING
    with engine.store.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(
            sa.text("UPDATE agentruns_runs SET message_count = 2 WHERE id = :id"), {"id": run.id}
        )
    engine.resume(engine.approval_token(run.id), approved=True)
    assert engine.idle(10)
    failed = engine.get_run(run.id)
    assert failed.status is RunStatus.FAILED and failed.error is not None
    assert failed.error.code == "invalid_checkpoint", failed.error
    assert "holds more steps or messages than its counters say" in failed.error.message
    assert f"run {run.id} failed: invalid_checkpoint" in caplog.text  # said at WARNING


def test_an_outage_reported_with_no_on_error_is_one_warning_line(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A worker (an engine with no on_error) logged a traceback for each run a Redis or
    # Postgres outage reached.
    agents = [Agent("a", ScriptedModel([text("ok")]))]
    engine = Engine(
        SqlStore(sqlite_url),
        leases=RedisLeases("redis://127.0.0.1:1/0"),  # nothing listens there
        scheduler=ManualScheduler(),
        agents=agents,
        secret="s",
    )
    try:
        run = engine.dispatch("a", trigger({}))
        assert engine.execute(run.id).status is RunStatus.QUEUED  # its lease: unreachable
    finally:
        engine.close()
    said = [r for r in caplog.records if r.getMessage().startswith("agentruns: ConnectionError")]
    assert said and all(r.levelname == "WARNING" and r.exc_info is None for r in said)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_an_execution_an_outage_stops_is_said_with_its_run_and_what_becomes_of_it(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A worker said only "agentruns: OperationalError: ...": not which run, nor that
    # it was left for recover.
    away = contextlib.ExitStack()

    def answer(messages: Any) -> Any:
        away.enter_context(database_away(db_url))  # its response cannot be saved
        return text("ok")

    agents = [Agent("a", ScriptedModel(answer))]
    engine = Engine(
        SqlStore(db_url),
        leases=LocalLeases(),
        scheduler=ManualScheduler(),
        agents=agents,
        secret="s",
    )
    try:
        run = engine.dispatch("a", trigger({}))
        with away:
            engine.execute(run.id)
    finally:
        engine.close()
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    line = f"agentruns: run {run.id} let go, for recover: OperationalError: "
    assert any(m.startswith(line) for m in said), said


def test_a_reply_of_a_server_tools_call_and_result_alone_completes(
    make_engine: EngineFactory,
) -> None:
    # Not "no answer": the API ran a tool of its own (its blocks are the answer).
    searched = [
        {"type": "server_tool_use", "id": "srv_1", "name": "web_search", "input": {"query": "x"}},
        {"type": "web_search_tool_result", "tool_use_id": "srv_1", "content": []},
    ]
    engine = make_engine([Agent("a", ScriptedModel([searched]))])
    run = _run_to_end(engine)
    assert run.status is RunStatus.COMPLETED, run.error
    checkpoint = engine.checkpoint(run.id)
    assert checkpoint is not None and checkpoint.messages[-1]["content"] == searched


def test_blank_text_beside_a_tool_call_is_left_out_of_the_transcript(
    make_engine: EngineFactory,
) -> None:
    # The Messages API refuses a whitespace text block in a request: stored, it
    # would fail the run's next model call.
    model = ScriptedModel([[text("\n"), tool_use("search_issues", {"query": "x"})], text("ok")])
    run = _run_to_end(make_engine([Agent("a", model, tools=[search_issues])]))
    assert run.status is RunStatus.COMPLETED
    sent_back = model.calls[1][1]
    assert sent_back["role"] == "assistant"
    assert [b["type"] for b in sent_back["content"]] == ["tool_use"]


def test_state_tools_read_and_merge_state_saved_with_the_checkpoint(
    make_engine: EngineFactory,
) -> None:
    class Notes(BaseModel):
        seen: int = 0
        label: str = "none"

    model = ScriptedModel(
        [
            tool_use("update_state", {"seen": 3}),
            tool_use("read_state", {}),
            text("ok"),
        ]
    )
    engine = make_engine([Agent("a", model, state=Notes)])
    run = _run_to_end(engine)
    assert run.status is RunStatus.COMPLETED
    assert json.loads(model.calls[2][-1]["content"][0]["content"]) == {"seen": 3, "label": "none"}
    checkpoint = engine.checkpoint(run.id)
    assert checkpoint is not None and checkpoint.state == {"seen": 3, "label": "none"}


@pytest.mark.parametrize("interrupted", [False, True], ids=["whole", "interrupted"])
def test_a_threads_next_run_starts_with_the_state_its_previous_run_ended_with(
    make_engine: EngineFactory, interrupted: bool
) -> None:
    # It started from the default state, while its transcript showed the model
    # setting another: read_state contradicted what the model had seen.
    class Notes(BaseModel):
        seen: int = 0

    script = [
        tool_use("update_state", {"seen": 7}),
        text("saved"),
        tool_use("read_state", {}),
        text("read"),
    ]
    model = ScriptedModel(script)
    engine = make_engine([Agent("a", model, state=Notes)], scheduler=ManualScheduler())
    first = engine.dispatch("a", trigger({"q": 1}), thread="chat")
    assert engine.execute(first.id).status is RunStatus.COMPLETED
    second = engine.dispatch("a", trigger({"q": 2}), thread="chat")
    if interrupted:
        # Drained in its first model call, with nothing of its own saved: its next
        # execution, on another engine, starts from the state it inherited.
        slow = ScriptedModel(script, latency_s=30)
        drained = make_engine([Agent("a", slow, state=Notes)], scheduler=ManualScheduler())
        worker = threading.Thread(target=drained.execute, args=(second.id,))
        worker.start()
        wait_for(lambda: slow.calls, "its model call")
        drained.drain()
        worker.join(10)
        assert engine.get_run(second.id).status is RunStatus.INTERRUPTED
        assert engine.recover() == [second.id]
    assert engine.execute(second.id).status is RunStatus.COMPLETED
    assert json.loads(model.calls[-1][-1]["content"][0]["content"]) == {"seen": 7}
    checkpoint = engine.checkpoint(second.id)
    assert checkpoint is not None and checkpoint.state == {"seen": 7}


class _Seen(BaseModel):
    seen: int = 0


class _Renamed(BaseModel):  # the same agent's state model, redeployed
    model_config = ConfigDict(extra="forbid")
    count: int = 0


class _Added(BaseModel):
    seen: int = 0
    label: str = "none"


@pytest.mark.parametrize(
    ("model", "read"),
    [(_Renamed, {"count": 0}), (_Added, {"seen": 7, "label": "none"})],
    ids=["refused", "taken"],
)
def test_a_threads_state_is_taken_as_the_next_runs_state_model_takes_it(
    make_engine: EngineFactory, model: type[BaseModel], read: dict[str, Any]
) -> None:
    # Taken as it was, a state another model refuses stayed: read_state showed fields
    # the model does not have, and every update_state failed on them.
    first = ScriptedModel([tool_use("update_state", {"seen": 7}), text("saved")])
    before = make_engine([Agent("a", first, state=_Seen)], scheduler=ManualScheduler())
    run = before.dispatch("a", trigger({"q": 1}), thread="chat")
    assert before.execute(run.id).status is RunStatus.COMPLETED

    change = {"count": 1} if model is _Renamed else {"label": "new"}
    later = ScriptedModel(
        [text("unused")] * 2
        + [tool_use("read_state", {}), tool_use("update_state", change), text("done")]
    )
    after = make_engine([Agent("a", later, state=model)], scheduler=ManualScheduler())
    run = after.dispatch("a", trigger({"q": 2}), thread="chat")
    assert after.execute(run.id).status is RunStatus.COMPLETED
    results = [json.loads(call[-1]["content"][0]["content"]) for call in later.calls[1:]]
    assert results == [read, {**read, **change}]


def test_an_agents_concurrency_key_callable_is_checked(make_engine: EngineFactory) -> None:
    def by_issue(t: TriggerEnvelope) -> Any:
        return t.payload["issue"]

    engine = make_engine([Agent("a", ScriptedModel([text("ok")]), concurrency_key=by_issue)])
    assert engine.dispatch("a", trigger({"issue": 123})).concurrency_key == "123"
    with pytest.raises(InvalidTriggerError, match="concurrency_key is 600"):
        engine.dispatch("a", trigger({"issue": "i" * 600}))
    with pytest.raises(TypeError, match="returned list"):
        engine.dispatch("a", trigger({"issue": [1]}))
    assert len(engine.list_runs()) == 1


def test_an_agents_concurrency_key_is_held_to_the_checks_of_a_dispatched_one(
    make_engine: EngineFactory,
) -> None:
    # "" was stored as a key, so every run without an issue queued behind the others;
    # a lone surrogate raised a bare UnicodeEncodeError.
    def by_issue(t: TriggerEnvelope) -> Any:
        return t.keys.get("issue", "")

    agents = [
        Agent("a", ScriptedModel([text("ok")]), concurrency_key=by_issue),
        Agent("b", ScriptedModel([text("ok")]), concurrency_key=lambda t: "\ud800"),
        Agent("c", ScriptedModel([text("ok")]), concurrency_key=lambda t: "order\x00A"),
    ]
    engine = make_engine(agents)
    for agent, refused in (("a", "must not be empty"), ("b", "UTF-8"), ("c", "NUL")):
        with pytest.raises(InvalidTriggerError, match=f"concurrency_key .*{refused}"):
            engine.dispatch(agent, trigger({}))
    assert engine.list_runs() == []
    run = engine.dispatch("a", trigger({}, keys={"issue": "7"}))
    assert run.concurrency_key == "7"
    # One given to dispatch is the run's, whatever the agent's would be.
    assert engine.dispatch("b", trigger({}), concurrency_key="own").concurrency_key == "own"


def test_runs_of_one_concurrency_key_never_overlap(make_engine: EngineFactory) -> None:
    lock = threading.Lock()
    inside: list[int] = [0]
    most: list[int] = [0]

    @tool
    def work() -> str:
        """Hold the key a while."""
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.05)
        with lock:
            inside[0] -= 1
        return "done"

    model = ScriptedModel([tool_use("work"), text("ok")], latency_s=0.02)
    engine = make_engine([Agent("a", model, tools=[work])], slots=5)
    runs = [engine.dispatch("a", trigger({"n": i}), concurrency_key="k") for i in range(5)]
    assert engine.idle(20)
    finished = [engine.get_run(r.id) for r in runs]
    assert all(r.status is RunStatus.COMPLETED for r in finished)
    assert most[0] == 1
    # Oldest first: each run started after the previous one finished.
    for before, after in itertools.pairwise(finished):
        assert before.finished_at is not None and after.started_at is not None
        assert after.started_at >= before.finished_at


def test_a_threads_second_run_starts_from_the_first_runs_messages(
    make_engine: EngineFactory,
) -> None:
    model = ScriptedModel(lambda messages: text(f"answer {len(messages)}"))
    engine = make_engine([Agent("a", model)])
    first = engine.dispatch("a", trigger({"q": 1}), thread="chat-1")
    assert engine.idle(10)
    second = engine.dispatch("a", trigger({"q": 2}), thread="chat-1")
    assert engine.idle(10)
    assert second.concurrency_key == "thread:chat-1"
    second = engine.get_run(second.id)
    assert engine.get_run(first.id).output == "answer 1"
    assert second.output == "answer 3"
    sent = model.calls[1]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert json.loads(sent[2]["content"])["payload"] == {"q": 2}


def _thread_on_skewed_clocks(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> tuple[Engine, ScriptedModel, Callable[[float], None]]:
    """An engine whose runs answer with their transcript's length, and a way to set
    its clock off by some seconds, as a host's whose clock is wrong."""
    from agentruns.store import sql

    model = ScriptedModel(lambda messages: text(f"answer {len(messages)}"))
    engine = make_engine([Agent("a", model)], scheduler=ManualScheduler())
    real = sql.utcnow

    def clock_off_by(seconds: float) -> None:
        monkeypatch.setattr(sql, "utcnow", lambda: real() + timedelta(seconds=seconds))

    return engine, model, clock_off_by


def test_a_threads_runs_go_in_the_order_they_were_sent_whatever_the_clocks(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ordered by the senders' clocks, a run sent later by a host whose clock was
    # behind went first. A run's created_at is now Postgres' clock. (SQLite's
    # processes share one host's clock.)
    engine, _, clock_off_by = _thread_on_skewed_clocks(make_engine, monkeypatch)
    first = engine.dispatch("a", trigger({"q": 1}), thread="chat")
    clock_off_by(-30)  # the second is sent from a host whose clock is behind
    second = engine.dispatch("a", trigger({"q": 2}), thread="chat")
    clock_off_by(0)
    assert engine.execute(second.id).status is RunStatus.QUEUED  # not its turn
    assert engine.execute(first.id).output == "answer 1"
    assert engine.execute(second.id).output == "answer 3"


def test_a_thread_continues_the_run_that_completed_last_whatever_its_workers_clock(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Picked by finished_at from the writer's clock, the run a worker 30 s behind
    # completed looked older than the one before it: the next run skipped it.
    engine, model, clock_off_by = _thread_on_skewed_clocks(make_engine, monkeypatch)
    runs = [engine.dispatch("a", trigger({"q": q}), thread="chat") for q in range(3)]
    assert engine.execute(runs[0].id).output == "answer 1"
    clock_off_by(-30)
    assert engine.execute(runs[1].id).output == "answer 3"  # on a worker behind
    clock_off_by(0)
    assert engine.execute(runs[2].id).output == "answer 5"  # after both, not only the first
    seen = [json.loads(m["content"])["payload"] for m in model.calls[2] if m["role"] == "user"]
    assert seen == [{"q": 0}, {"q": 1}, {"q": 2}]


def _own_messages(engine: Engine) -> dict[str, int]:
    """How many message rows each run stored itself, by run id."""
    with engine.store.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT r.id, count(m.seq) FROM agentruns_runs AS r"
                " LEFT JOIN agentruns_messages AS m ON m.run_key = r.key GROUP BY r.id"
            )
        )
        return {run_id: n for run_id, n in rows}


def test_a_threads_runs_continue_each_other_without_copying_its_history(
    make_any_engine: EngineFactory,
) -> None:
    model = ScriptedModel(lambda messages: text(f"answer {len(messages)}"))
    engine = make_any_engine([Agent("a", model)])
    runs = []
    for q in range(6):
        runs.append(engine.dispatch("a", trigger({"q": q}), thread="chat"))
        assert engine.idle(10)
    assert [engine.get_run(r.id).output for r in runs] == [f"answer {2 * q + 1}" for q in range(6)]
    # The last run's transcript is the whole thread; each run stored only its own
    # question and answer (a copied history made the k-th run store 2k rows).
    last = engine.checkpoint(runs[-1].id)
    assert last is not None and len(last.messages) == 12
    asked = [json.loads(m["content"])["payload"] for m in last.messages if m["role"] == "user"]
    assert asked == [{"q": q} for q in range(6)]
    assert last.messages[-1]["content"][0]["text"] == "answer 11"
    assert _own_messages(engine) == {r.id: 2 for r in runs}


def test_a_thread_run_drained_in_its_first_step_continues_the_thread_once_recovered(
    make_engine: EngineFactory,
) -> None:
    model = ScriptedModel(lambda messages: text(f"answer {len(messages)}"), latency_s=0.3)
    first = make_engine([Agent("a", model)])
    r0 = first.dispatch("a", trigger({"q": 0}), thread="chat")
    assert first.idle(10)
    r1 = first.dispatch("a", trigger({"q": 1}), thread="chat")
    wait_for(lambda: len(model.calls) == 2)  # r1's first model call, nothing of its own saved
    first.drain(timeout=5)
    assert first.get_run(r1.id).status is RunStatus.INTERRUPTED

    second = make_engine([Agent("a", model)])
    assert second.recover() == [r1.id]
    assert second.idle(10)
    assert second.get_run(r1.id).output == "answer 3"
    assert [len(m) for m in model.calls] == [1, 3, 3]
    assert _own_messages(second) == {r0.id: 2, r1.id: 2}


def test_cancel_of_a_queued_run_is_immediate(make_engine: EngineFactory) -> None:
    engine = make_engine([Agent("a", ScriptedModel([text("ok")]))], scheduler=ManualScheduler())
    run = engine.dispatch("a", trigger({}))
    cancelled = engine.cancel(run.id)
    assert cancelled.status is RunStatus.CANCELLED
    assert engine.execute(run.id).status is RunStatus.CANCELLED
    assert engine.cancel(run.id).status is RunStatus.CANCELLED  # final: unchanged


def test_cancel_of_a_running_run_from_another_engine_aborts_it_within_a_second(
    make_engine: EngineFactory,
) -> None:
    model = ScriptedModel([text("too late")], latency_s=30)
    owner = make_engine([Agent("a", model)])
    other = make_engine([Agent("a", model)], scheduler=ManualScheduler())
    run = owner.dispatch("a", trigger({}))
    wait_for(lambda: len(model.calls) == 1)
    asked = time.monotonic()
    assert other.cancel(run.id).cancel_requested
    wait_for(lambda: other.get_run(run.id).status is RunStatus.CANCELLED, timeout=5)
    assert time.monotonic() - asked < 1.0
    assert other.get_run(run.id).claim is None


@pytest.mark.parametrize("store", ["postgres", "sqlite"])
def test_a_cancel_from_another_process_reaches_an_owner_without_redis_within_a_second(
    request: pytest.FixtureRequest, store: str
) -> None:
    # Leases of its own process (two CLIs on one database, say): the other's cancel
    # has no message to come by; the owner finds it in the store, well before the
    # renewal (every lease_ttl / 3) would.
    make_engine = engines_on(request, store)
    model = ScriptedModel([text("too late")], latency_s=30)
    owner = make_engine([Agent("a", model)], leases=LocalLeases(), lease_ttl=30.0)
    other = make_engine(
        [Agent("a", model)], leases=LocalLeases(), lease_ttl=30.0, scheduler=ManualScheduler()
    )
    run = owner.dispatch("a", trigger({}))
    wait_for(lambda: len(model.calls) == 1)
    asked = time.monotonic()
    assert other.cancel(run.id).cancel_requested
    wait_for(lambda: other.get_run(run.id).status is RunStatus.CANCELLED, timeout=5)
    assert time.monotonic() - asked < 1.5
    assert other.get_run(run.id).claim is None


def test_a_cancel_that_comes_as_the_run_starts_is_not_lost(
    make_engine: EngineFactory,
) -> None:
    # A listener of the "running" event cancels at once, through another engine
    # (Redis pub/sub), and keeps the event's delivery a while (a slow listener):
    # the model call that follows must be aborted, not run to its end.
    model = ScriptedModel([text("too late")], latency_s=5)
    owner = make_engine([Agent("a", model)], lease_ttl=30.0)
    other = make_engine([Agent("a", model)], scheduler=ManualScheduler())

    def cancel_as_it_starts(event: Any) -> None:
        if event.run.status is RunStatus.RUNNING:
            other.cancel(event.run.id)
            time.sleep(0.3)

    owner.on("run.updated", cancel_as_it_starts)
    run = owner.dispatch("a", trigger({}))
    wait_for(lambda: other.get_run(run.id).status is RunStatus.CANCELLED, timeout=3)


def test_a_cancel_heard_before_its_execution_is_kept_aborts_it_once_kept() -> None:
    # The window a claim leaves before the keeper knows the execution.
    from agentruns.execution import Abort
    from agentruns.keeper import LeaseKeeper

    class Execution:
        run_id = "r"
        reason: Abort | None = None

        def abort(self, reason: Abort) -> None:
            self.reason = reason

    keeper = LeaseKeeper(LocalLeases(), None, "me", 30.0, print, print)  # type: ignore[arg-type]
    keeper.abort("r", Abort.CANCEL)
    keeper.abort("elsewhere", Abort.CANCEL)
    execution = Execution()
    keeper.keep(execution, None, time.monotonic())  # type: ignore[arg-type]
    keeper.stop()
    assert execution.reason is Abort.CANCEL
    later = Execution()
    keeper.keep(later, None, time.monotonic())  # type: ignore[arg-type]
    assert later.reason is None  # heard once, applied once


def test_a_cancel_flagged_as_the_run_pauses_for_approval_cancels_it(
    make_engine: EngineFactory,
) -> None:
    notified: list[str] = []
    # In-process leases: this engine's cancel reaches the owner only as the flag.
    other = make_engine([], leases=LocalLeases(), scheduler=ManualScheduler())

    def cancel_then_ask(arguments: dict[str, Any], ctx: ToolContext) -> bool:
        other.cancel(ctx.run.id)  # the run is running: the cancel flags it
        return True

    @tool(needs_approval=cancel_then_ask)
    def post(body: str) -> str:
        """Post something."""
        return "posted"

    model = ScriptedModel([tool_use("post", {"body": "hi"}), text("ok")])
    agent = Agent(
        "a", model, tools=[post], notifier=lambda run, wait, token: notified.append(token)
    )
    run = _run_to_end(make_engine([agent]))
    assert run.status is RunStatus.CANCELLED and run.waiting is None
    assert notified == []


@pytest.mark.parametrize("store", ["postgres", "sqlite"])
def test_a_cancel_flagged_as_the_final_answer_comes_cancels_the_run(
    make_engine: EngineFactory, make_sqlite_engine: EngineFactory, store: str
) -> None:
    """The model's final answer came before its owner heard of the cancel, which
    cancel() had already flagged and returned: the run completed. A cancel asked
    for while a run runs now wins; the answer stays in the transcript."""
    factory = make_engine if store == "postgres" else make_sqlite_engine
    # In-process leases: this engine's cancel reaches the owner only as the flag.
    other = factory([], leases=LocalLeases(), scheduler=ManualScheduler())

    class AnswersAsItIsCancelled:
        name = "answers"

        def complete(self, request: Any, signal: threading.Event) -> ModelResponse:
            flagged = other.cancel(request_run[0])
            assert flagged.status is RunStatus.RUNNING and flagged.cancel_requested
            return ModelResponse(
                content=[{"type": "text", "text": "Done anyway."}], stop_reason="end_turn"
            )

    request_run: list[str] = []
    engine = factory([Agent("a", AnswersAsItIsCancelled())], scheduler=ManualScheduler())
    run = engine.dispatch("a", trigger({}))
    request_run.append(run.id)
    done = engine.execute(run.id)
    assert done.status is RunStatus.CANCELLED, done
    assert done.output is None and done.claim is None and done.finished_at is not None
    assert engine.get_run(run.id).status is RunStatus.CANCELLED
    assert engine.checkpoint(run.id).messages[-1]["content"][0]["text"] == "Done anyway."
    assert engine.cancel(run.id).status is RunStatus.CANCELLED  # final: unchanged


def test_two_drains_at_once_both_return_once_the_runs_settle(
    make_engine: EngineFactory,
) -> None:
    # Each took what slots it could: neither got all of them, and both waited out
    # their timeout (a worker's cold shutdown drained twice, and stopped 10 s late).
    started = threading.Event()

    @tool
    def slow(q: str) -> str:
        """Take a second."""
        started.set()
        time.sleep(1.0)
        return q

    model = ScriptedModel([tool_use("slow", {"q": "x"}), text("ok")])
    engine = make_engine([Agent("a", model, tools=[slow])], slots=4)
    run = engine.dispatch("a", trigger({}))
    assert started.wait(10)
    begun = time.monotonic()
    drains = [threading.Thread(target=engine.drain, kwargs={"timeout": 10}) for _ in "ab"]
    for drain in drains:
        drain.start()
    for drain in drains:
        drain.join(15)
    assert time.monotonic() - begun < 5
    assert engine.get_run(run.id).status is RunStatus.INTERRUPTED


def test_a_run_claimed_as_a_drain_begins_is_interrupted_before_drain_returns(
    make_engine: EngineFactory,
) -> None:
    class GatedLeases(LocalLeases):
        """Holds an execution between its look at the drain flag and its claim."""

        reached = threading.Event()
        go = threading.Event()

        def acquire(self, *args: Any, **kwargs: Any) -> bool:
            self.reached.set()
            self.go.wait(5)
            return super().acquire(*args, **kwargs)

    steps = [tool_use("search_issues", {"query": str(i)}) for i in range(5)] + [text("ok")]
    model = ScriptedModel(steps, latency_s=0.1)
    engine = make_engine(
        [Agent("a", model, tools=[search_issues])],
        leases=GatedLeases(),
        scheduler=ManualScheduler(),
    )
    run = engine.dispatch("a", trigger({}))
    executing = threading.Thread(target=engine.execute, args=(run.id,))
    executing.start()
    assert GatedLeases.reached.wait(5)
    draining = threading.Thread(target=engine.drain)
    draining.start()
    time.sleep(0.2)  # the drain has begun; the execution claims the run now
    GatedLeases.go.set()
    draining.join(10)
    assert not draining.is_alive()
    # drain() returned: nothing of this engine runs any more.
    assert engine.get_run(run.id).status is RunStatus.INTERRUPTED
    executing.join(10)
    assert engine.get_run(run.id).status is RunStatus.INTERRUPTED


def test_a_lease_lost_after_a_timeout_still_stops_every_write(
    make_engine: EngineFactory, errors: Errors, redis_prefix: str
) -> None:
    @tool
    def slow() -> str:
        """Take a while, never looking at the abort signal."""
        time.sleep(1.5)
        return "done"

    model = ScriptedModel([tool_use("slow", {}), text("ok")])
    agent = Agent("a", model, tools=[slow], budget=Budget(timeout_s=0.3))
    engine = make_engine([agent], lease_ttl=0.6)
    run = engine.dispatch("a", trigger({}))
    wait_for(lambda: engine.steps(run.id))  # the response is saved; the tool runs
    time.sleep(0.5)  # the timeout has fired: the execution will settle when the tool returns
    redis.Redis.from_url(REDIS_URL).delete(f"{redis_prefix}:lease:{run.id}")  # lost
    assert engine.idle(10)
    # Lost after the timeout, the lease still decides: nothing more is written.
    assert [s.kind for s in engine.steps(run.id)] == ["llm"]
    assert engine.get_run(run.id).status is RunStatus.RUNNING
    assert errors.of(LeaseLostError)


@pytest.mark.parametrize("how", ["execute", "dispatch_here"])
def test_execute_returns_the_run_as_stored_after_its_lease_was_lost(
    how: str, make_engine: EngineFactory, errors: Errors, redis_prefix: str
) -> None:
    # It returned the run as its execution last wrote it: running, though another
    # engine had finished it meanwhile.
    stalled, go_on = threading.Event(), threading.Event()

    @tool
    def slow() -> str:
        """Take a while, never looking at the abort signal."""
        if not stalled.is_set():
            stalled.set()
            assert go_on.wait(20)
        return "done"

    def agent() -> Agent:
        return Agent("a", ScriptedModel([tool_use("slow", {}), text("ok")]), tools=[slow])

    first = make_engine([agent()], scheduler=ManualScheduler(), lease_ttl=0.6, requeue_after=0.1)
    second = make_engine([agent()], scheduler=ManualScheduler(), lease_ttl=0.6, requeue_after=0.1)
    returned: list[Run] = []
    if how == "execute":
        run_id = first.dispatch("a", trigger({})).id
        executing = threading.Thread(target=lambda: returned.append(first.execute(run_id)))
    else:
        executing = threading.Thread(
            target=lambda: returned.append(first.dispatch_here("a", trigger({})))
        )
    executing.start()
    assert stalled.wait(10)
    run_id = first.list_runs()[0].id
    redis.Redis.from_url(REDIS_URL).delete(f"{redis_prefix}:lease:{run_id}")  # lost
    wait_for(lambda: second.recover() == [run_id], timeout=10)  # once its claim expired
    assert second.execute(run_id).status is RunStatus.COMPLETED
    go_on.set()
    executing.join(10)
    assert returned[0].status is RunStatus.COMPLETED, returned[0]
    assert errors.of(LeaseLostError)


def test_drain_then_recover_finishes_the_run_without_losing_or_repeating_a_step(
    make_engine: EngineFactory,
) -> None:
    model = ScriptedModel(
        [
            tool_use("search_issues", {"query": "a"}),
            tool_use("search_issues", {"query": "b"}),
            text("done"),
        ],
        latency_s=0.3,
    )
    first = make_engine([Agent("a", model, tools=[search_issues])])
    run = first.dispatch("a", trigger({}))
    wait_for(lambda: len(model.calls) == 2)  # second model call in flight
    first.drain(timeout=5)
    drained = first.get_run(run.id)
    assert drained.status is RunStatus.INTERRUPTED and drained.claim is None

    second = make_engine([Agent("a", model, tools=[search_issues])])
    assert second.recover() == [run.id]
    assert second.idle(10)
    done = second.get_run(run.id)
    assert done.status is RunStatus.COMPLETED
    kinds = [(s.index, s.kind) for s in second.steps(run.id)]
    assert kinds == [(0, "llm"), (1, "tool"), (2, "llm"), (3, "tool"), (4, "llm")]
    assert second.recover() == []


def _mid_step_agent(done: list[str], started: threading.Event) -> Agent:
    """One step of three calls: a slow one that heeds the abort, a charge, a note."""

    @tool
    def slow(ctx: ToolContext) -> str:
        """Look something up, slowly."""
        done.append("slow")
        started.set()
        ctx.signal.wait(10)
        return "aborted" if ctx.signal.is_set() else "found"

    @tool(effect=True)
    def charge(amount: int) -> str:
        """Charge a card."""
        done.append("charge")
        return f"charged {amount}"

    @tool
    def note() -> str:
        """Take a note."""
        done.append("note")
        return "noted"

    calls = [tool_use("slow", {}), tool_use("charge", {"amount": 5}), tool_use("note", {})]
    return Agent("a", ScriptedModel([calls, text("done")]), tools=[slow, charge, note])


def test_a_cancel_mid_step_starts_none_of_the_steps_later_calls(
    make_any_engine: EngineFactory,
) -> None:
    done: list[str] = []
    started = threading.Event()
    owner = make_any_engine([_mid_step_agent(done, started)])
    run = owner.dispatch("a", trigger({}))
    assert started.wait(10)
    asked = time.monotonic()
    owner.cancel(run.id)
    wait_for(lambda: owner.get_run(run.id).status is RunStatus.CANCELLED, timeout=5)
    assert time.monotonic() - asked < 1.0
    assert owner.idle(10)
    assert done == ["slow"]  # not the charge, not the note
    assert [s.name for s in owner.steps(run.id) if s.kind == "tool"] == ["slow"]


def test_a_cancel_asked_for_as_a_drain_stops_the_run_leaves_it_cancelled(
    make_any_engine: EngineFactory,
) -> None:
    # The drain had stopped the run first: it settled interrupted, its cancel only
    # flagged, and stayed so until a recovery (with no worker left, for good).
    started, finish = threading.Event(), threading.Event()

    @tool
    def slow(q: str) -> str:
        """Take a while."""
        started.set()
        assert finish.wait(10)
        return q

    model = ScriptedModel([tool_use("slow", {"q": "x"}), text("ok")])
    engine = make_any_engine([Agent("a", model, tools=[slow])])
    run = engine.dispatch("a", trigger({}))
    assert started.wait(10)
    drain = threading.Thread(target=engine.drain, kwargs={"timeout": 10})
    drain.start()
    wait_for(lambda: engine._draining)
    flagged = engine.cancel(run.id)
    assert flagged.status is RunStatus.RUNNING and flagged.cancel_requested
    finish.set()
    drain.join(15)
    settled = engine.get_run(run.id)
    assert settled.status is RunStatus.CANCELLED and settled.finished_at is not None
    assert [s.kind for s in engine.steps(run.id)] == ["llm", "tool"]  # its work kept
    assert engine.recover() == []


def test_a_drain_mid_step_keeps_the_calls_done_and_recovery_runs_the_rest_once(
    make_any_engine: EngineFactory,
) -> None:
    done: list[str] = []
    started = threading.Event()
    first = make_any_engine([_mid_step_agent(done, started)])
    run = first.dispatch("a", trigger({}))
    assert started.wait(10)
    first.drain(timeout=5)
    assert first.get_run(run.id).status is RunStatus.INTERRUPTED
    assert done == ["slow"]

    second = make_any_engine([_mid_step_agent(done, threading.Event())])
    assert second.recover() == [run.id]
    assert second.idle(10)
    assert second.get_run(run.id).status is RunStatus.COMPLETED
    assert done == ["slow", "charge", "note"]  # the slow call is not made again
    tools = [s.name for s in second.steps(run.id) if s.kind == "tool"]
    assert tools == ["slow", "charge", "note"]
    checkpoint = second.checkpoint(run.id)
    assert checkpoint is not None
    results = checkpoint.messages[2]["content"]
    assert [r["content"] for r in results] == ["aborted", "charged 5", "noted"]


def test_a_drained_thread_run_goes_first_again_and_its_thread_keeps_its_order(
    make_any_engine: EngineFactory,
) -> None:

    # r1 is drained (a deploy) while r2 of its thread is queued behind it: r2 must
    # not overtake it, or r2 would start from a history without r1's exchange and
    # the thread's next run from a history without r2's.
    def results(message: dict[str, Any]) -> bool:
        content = message["content"]
        return isinstance(content, list) and content[0].get("type") == "tool_result"

    def script(messages: list[dict[str, Any]]) -> Any:
        if not results(messages[-1]):  # a new question: look something up first
            return tool_use("search_issues", {"query": "q"})
        asked = [m for m in messages if m["role"] == "user" and not results(m)]
        return text(f"answered {len(asked)} questions")

    model = ScriptedModel(script, latency_s=0.3)
    # This engine executes r1 only: r2's own execution comes later, elsewhere.
    first = make_any_engine([Agent("a", model, tools=[search_issues])], scheduler=ManualScheduler())
    r1 = first.dispatch("a", trigger({"n": 1}), thread="chat")
    threading.Thread(target=first.execute, args=(r1.id,), daemon=True).start()
    wait_for(lambda: len(model.calls) == 2)  # r1's second model call in flight
    r2 = first.dispatch("a", trigger({"n": 2}), thread="chat")
    first.drain(timeout=5)
    assert first.get_run(r1.id).status is RunStatus.INTERRUPTED

    second = make_any_engine([Agent("a", model, tools=[search_issues])])
    assert second.execute(r2.id).status is RunStatus.QUEUED  # r1 goes first
    assert second.recover() == [r1.id]
    assert second.idle(10)
    assert [second.get_run(r.id).status for r in (r1, r2)] == [RunStatus.COMPLETED] * 2
    r1_done, r2_done = second.get_run(r1.id), second.get_run(r2.id)
    assert r1_done.finished_at is not None and r2_done.started_at is not None
    assert r2_done.started_at >= r1_done.finished_at
    # r2 continued the thread from r1's whole exchange (4 messages) plus its own.
    assert len(second.checkpoint(r2.id).messages) == 8
    assert r2_done.output == "answered 2 questions"


def test_an_engines_agents_may_come_from_a_generator(sqlite_url: str) -> None:
    # The check of each agent used the generator up: the engine had no agents.
    agents = (Agent(name, ScriptedModel([text("ok")])) for name in ("a", "b"))
    engine = Engine(SqlStore(sqlite_url), leases=LocalLeases(), agents=agents, secret="s")
    assert sorted(engine.agents) == ["a", "b"]
    engine.close()


def test_a_listener_that_is_not_a_function_is_refused(make_engine: EngineFactory) -> None:
    # Taken, it made every event report a TypeError to on_error.
    engine = make_engine([])
    with pytest.raises(TypeError, match="a listener is a function of the event, not 5"):
        engine.on("run.updated", 5)  # type: ignore[call-overload]


@pytest.mark.parametrize("returned", [None, {"content": [], "stop_reason": "end_turn"}])
def test_a_model_of_ones_own_returning_no_model_response_fails_model_error(
    make_engine: EngineFactory, returned: Any
) -> None:
    # It failed internal_error, as a bug of agentruns', and ScriptedModel's model_error.
    class Odd:
        name = "odd"

        def complete(self, request: Any, signal: threading.Event) -> Any:
            return returned

    run = _run_to_end(make_engine([Agent("a", Odd())]))
    assert run.status is RunStatus.FAILED
    assert run.error == RunError(
        code="model_error",
        message="malformed model reply: the model returned"
        f" {type(returned).__name__}, not a ModelResponse",
    )


@pytest.mark.parametrize("raised", [SystemExit(2), asyncio.CancelledError()], ids=repr)
def test_a_listener_that_exits_in_a_pool_thread_reaches_on_error_and_the_run_completes(
    make_engine: EngineFactory, errors: Errors, raised: BaseException
) -> None:
    # argparse in a listener exits on bad arguments, asyncio.run() of a cancelled
    # task raises CancelledError: it ended the execution unsettled, and the run
    # stayed running with its claim until its lease expired and recover() took it.
    engine = make_engine([Agent("a", ScriptedModel([text("ok")]))])

    def exits(event: Event) -> None:
        if event.run is not None and event.run.status is RunStatus.RUNNING:
            raise raised

    engine.on("run.updated", exits)
    run = engine.dispatch("a", trigger({}))
    assert engine.idle(10)
    done = engine.get_run(run.id)
    assert done.status is RunStatus.COMPLETED and done.claim is None
    assert any(f"a listener raised {raised!r}" in str(e) for e in errors)


def test_a_listener_interrupted_in_the_main_thread_leaves_nothing_undelivered(
    make_engine: EngineFactory,
) -> None:
    # Ctrl-C in a step's listener stops an execution in the main thread (the run is
    # left for recover, as after a crash); the run.updated queued behind the step's
    # event stayed counted as undelivered, and idle() never said True again.
    engine = make_engine([Agent("a", ScriptedModel([text("ok")]))], scheduler=ManualScheduler())
    interrupted: list[int] = []

    def interrupt(event: Event) -> None:
        if event.step is not None and not interrupted:
            interrupted.append(event.step.index)
            raise KeyboardInterrupt

    engine.on("step.appended", interrupt)
    run = engine.dispatch("a", trigger({}))
    with pytest.raises(KeyboardInterrupt):
        engine.execute(run.id)
    assert interrupted == [0]
    assert engine.idle(5)


def test_a_listener_that_dispatches_the_next_run_under_its_own_lock_does_not_deadlock(
    make_engine: EngineFactory,
) -> None:
    # Listeners run on several threads, so one keeps its state under a lock; this
    # one chains a run when the first completes. The new run's event was delivered
    # inside the listener that caused it, on its thread: it waited for its own lock.
    engine = make_engine(
        [
            Agent("first", ScriptedModel([text("one")])),
            Agent("second", ScriptedModel([text("two")])),
        ]
    )
    lock = threading.Lock()
    seen: list[tuple[str, str]] = []
    stuck: list[Event] = []

    def chain(event: Event) -> None:
        assert event.run is not None
        if not lock.acquire(timeout=3):  # (with no timeout: for good)
            stuck.append(event)
            return
        try:
            seen.append((event.run.agent, event.run.status.value))
            if event.run.agent == "first" and event.run.status is RunStatus.COMPLETED:
                engine.dispatch("second", trigger({"after": event.run.id}))
        finally:
            lock.release()

    engine.on("run.updated", chain)
    engine.dispatch("first", trigger({}))
    assert engine.idle(10)
    assert stuck == []
    assert ("second", "completed") in seen
    # The event the listener caused came after the one it was handling.
    assert seen.index(("first", "completed")) < seen.index(("second", "queued"))


def test_a_closed_engine_refuses_new_work_saying_so_and_still_reads(
    make_engine: EngineFactory,
) -> None:
    # A dispatch after close() stored a queued run that its closed scheduler dropped:
    # it waited for a recover() after requeue_after, silently. An execute did nothing.
    engine = make_engine([Agent("triage", ScriptedModel([text("ok")]))])
    run = engine.dispatch("triage", trigger({}))
    assert engine.idle(10)
    engine.close()
    calls: list[Callable[[], object]] = [
        lambda: engine.dispatch("triage", trigger({"n": 2})),
        lambda: engine.dispatch_here("triage", trigger({"n": 3})),
        lambda: engine.execute(run.id),
        lambda: engine.cancel(run.id),
        lambda: engine.resume("token", approved=True),
        engine.recover,
        engine.tick,
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match="this engine is closed"):
            call()
    assert [r.id for r in engine.list_runs()] == [run.id]  # nothing was stored
    assert engine.get_run(run.id).status is RunStatus.COMPLETED
    engine.close()  # twice is harmless


def test_an_engine_refuses_new_work_once_its_close_has_begun(make_engine: EngineFactory) -> None:
    # A dispatch while close() was under way was stored queued and dropped by the
    # closing scheduler; it waited for a recover() after requeue_after.
    engine = make_engine([Agent("triage", ScriptedModel([text("ok")]))])
    closing = threading.Event()

    def slow_closer() -> None:  # a listener's own resource, say
        closing.set()
        time.sleep(0.5)

    engine.close_with(slow_closer)
    closer = threading.Thread(target=engine.close)
    closer.start()
    assert closing.wait(10)
    with pytest.raises(RuntimeError, match="this engine is closed"):
        engine.dispatch("triage", trigger({}))
    closer.join(10)
    assert engine.list_runs() == []


def test_a_listener_that_raises_reaches_on_error_and_the_run_completes(
    make_engine: EngineFactory, errors: Errors
) -> None:
    engine = make_engine([Agent("a", ScriptedModel([text("ok")]))])

    def broken(_: Any) -> None:
        raise RuntimeError("listener broke")

    engine.on("run.updated", broken)
    run = _run_to_end(engine)
    assert run.status is RunStatus.COMPLETED
    assert any(str(e) == "listener broke" for e in errors)


def test_a_writes_events_are_made_for_listeners_only(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every write made its steps and events, listened to or not: about a tenth of
    the engine's own time per model step (bench figure 1). A listener that comes
    later still gets every step of the writes after it, in order."""
    import agentruns.store.sql

    built: list[int] = []
    new_steps = agentruns.store.sql.new_steps

    def counted(*args: Any) -> Any:
        steps = new_steps(*args)
        built.append(len(steps))
        return steps

    monkeypatch.setattr(agentruns.store.sql, "new_steps", counted)
    model = ScriptedModel([tool_use("search_issues", {"query": "crash"}), text("Found.")])
    engine = make_engine([Agent("a", model, tools=[search_issues])])
    assert _run_to_end(engine).status is RunStatus.COMPLETED
    assert built == []  # nobody listened: no steps made, nothing queued

    seen: list[int] = []
    engine.on("step.appended", lambda e: seen.append(e.step.index if e.step else -1))
    run = _run_to_end(engine)
    assert run.status is RunStatus.COMPLETED
    assert seen == [s.index for s in engine.steps(run.id)] == [0, 1, 2]
    assert sum(built) == 3
    assert not engine.events.busy()


def test_recover_requeues_a_queued_run_whose_message_was_lost(
    make_engine: EngineFactory,
) -> None:
    lost = make_engine([Agent("a", ScriptedModel([text("ok")]))], scheduler=ManualScheduler())
    engine = make_engine([Agent("a", ScriptedModel([text("ok")]))], requeue_after=1.0)
    run = lost.dispatch("a", trigger({}))
    assert engine.recover() == []  # queued for less than requeue_after: left alone
    time.sleep(1.1)
    assert engine.recover() == [run.id]
    assert engine.idle(10)
    assert engine.get_run(run.id).status is RunStatus.COMPLETED


def _lost_with_its_worker(engine: Engine, run_id: str) -> Claimed:
    """The run claimed by a worker that died at once: its claim just expired, no lease held."""
    claimed = engine.store.claim(run_id, "dead:1", utcnow() - timedelta(milliseconds=1))
    assert claimed is not None
    return claimed


def test_recover_holds_back_a_run_lost_again_and_again_at_one_step_and_fails_none(
    make_any_engine: EngineFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # A step that ended its worker's process (a crash, an out-of-memory kill) did so
    # on every recovery, each sweep: the run took down one worker after another, and
    # every run those workers held went down with it.
    agents = [Agent("a", ScriptedModel([text("ok")]))]
    engine = make_any_engine(agents, scheduler=ManualScheduler(), requeue_after=0.4)
    run = engine.dispatch("a", trigger({}), schedule=False)
    _lost_with_its_worker(engine, run.id)
    assert engine.recover() == [run.id]  # the first loss: at once
    for losses in (1, 2):
        _lost_with_its_worker(engine, run.id)
        since = time.monotonic()
        assert engine.recover() == []  # lost again at its step: it waits
        wait_for(lambda: engine.recover() == [run.id], "the requeue", timeout=10)
        assert time.monotonic() - since >= held_back(run.id, losses, 0.4) - 0.05
        assert f"lost with its worker {losses + 1} times in a row at step 0" in caplog.text
    assert engine.get_run(run.id).status is RunStatus.QUEUED
    assert engine.execute(run.id).status is RunStatus.COMPLETED


def test_a_run_its_live_worker_gave_up_is_requeued_at_once_however_often(
    make_engine: EngineFactory,
) -> None:
    # A worker that let its run go (an outage, a lost lease) left it as a dead worker
    # does: a database that kept failing at one step held the run back, as a step
    # that kills its worker is.
    tries: list[int] = []

    @tool
    def slow_step(ctx: ToolContext) -> str:
        """A step during which the worker loses its lease."""
        tries.append(1)
        engine.leases.release(ctx.run.id, engine.owner)
        ctx.signal.wait(5)  # the keeper's next renewal fails: the execution aborts
        return "done"

    agents = [Agent("a", ScriptedModel([tool_use("slow_step", {}), text("ok")]), tools=[slow_step])]
    engine = make_engine(agents, scheduler=ManualScheduler(), requeue_after=30.0)
    run = engine.dispatch("a", trigger({}), schedule=False)
    for attempt in range(3):
        assert engine.execute(run.id).status is RunStatus.RUNNING  # given up, left running
        assert len(tries) == attempt + 1
        # Not held back (that would be 15-45 s): requeued once its claim expires.
        wait_for(lambda: engine.recover() == [run.id], "the requeue", timeout=6)


def test_runs_lost_together_wait_different_times_doubling_up_to_an_hour() -> None:
    # Runs that died in the same workers as a step that kills them were lost as often
    # at their steps: requeued at the same moments, they died with it every time.
    holds = [held_back(f"run-{n}", 2, 60.0) for n in range(50)]
    assert all(60.0 <= hold < 180.0 for hold in holds)  # 120 s, spread by half
    assert len(set(holds)) == 50 and max(holds) - min(holds) > 60.0
    assert held_back("run-1", 2, 60.0) == held_back("run-1", 2, 60.0)  # every sweeper's
    assert held_back("run-1", 0, 60.0) == 0.0
    assert 1800.0 <= held_back("run-1", 30, 60.0) < 5400.0  # an hour at most, spread
    assert 1800.0 <= held_back("run-1", 5000, 60.0) < 5400.0  # 2.0 ** 1024 overflowed


def test_a_held_back_run_is_cancelled_at_once_and_a_drain_ends_its_count(
    make_any_engine: EngineFactory,
) -> None:
    # A cancel of a run held back waited out the hold (up to an hour and a half), and
    # its concurrency key's line with it.
    agents = [Agent("a", ScriptedModel([text("ok")]))]
    engine = make_any_engine(agents, scheduler=ManualScheduler(), requeue_after=30.0)
    held = engine.dispatch("a", trigger({"n": 1}), schedule=False)
    _lost_with_its_worker(engine, held.id)
    assert engine.recover() == [held.id]  # the first loss: at once
    _lost_with_its_worker(engine, held.id)
    assert engine.recover() == []  # the second: held back (15-45 s)
    engine.cancel(held.id)
    assert engine.recover() == [held.id]
    assert engine.execute(held.id).status is RunStatus.CANCELLED
    # Losses in a row end with a drain: the next loss at that step is the first.
    drained = engine.dispatch("a", trigger({"n": 2}), schedule=False)
    _lost_with_its_worker(engine, drained.id)
    assert engine.recover() == [drained.id]
    claimed = engine.store.claim(drained.id, engine.owner, utcnow() + timedelta(seconds=30))
    assert claimed is not None
    guard = Guard(status=RunStatus.RUNNING, epoch=claimed.epoch)
    interrupt = Commit(status=RunStatus.INTERRUPTED, release_claim=True)
    assert engine.store.commit(claimed.run, guard, interrupt) is not None
    assert engine.recover() == [drained.id]
    _lost_with_its_worker(engine, drained.id)
    assert engine.recover() == [drained.id]  # not held back: the first loss in a row


def test_a_run_lost_at_different_steps_is_requeued_at_once_each_time(
    make_any_engine: EngineFactory,
) -> None:
    # Only losses in a row at one step count: a run that got on between them (a
    # long run, its workers killed by deploys) is not held back for them.
    agents = [Agent("a", ScriptedModel([text("ok")]))]
    engine = make_any_engine(agents, scheduler=ManualScheduler(), requeue_after=30.0)
    run = engine.dispatch("a", trigger({}), schedule=False)
    for _ in range(3):
        claimed = _lost_with_its_worker(engine, run.id)
        guard = Guard(status=RunStatus.RUNNING, epoch=claimed.epoch)
        step = NewStep(kind="tool", name="t", started_at=utcnow(), finished_at=utcnow())
        assert engine.store.commit(claimed.run, guard, Commit(steps=[step])) is not None
        assert engine.recover() == [run.id]  # lost at steps 1, 2 and 3, once each
    _lost_with_its_worker(engine, run.id)
    assert engine.recover() == []  # lost at step 3 again: held back (15-45 s)


def test_recover_says_why_it_requeued_each_run(
    make_engine: EngineFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # A worker's log said only "recover requeued 3 run(s)" and their ids.
    caplog.set_level("INFO", logger="agentruns")
    agents = [Agent("a", ScriptedModel([text("ok")]))]
    engine = make_engine(agents, scheduler=ManualScheduler(), requeue_after=0.3)
    lost, let_go, drained, forgotten = (
        engine.dispatch("a", trigger({"n": n}), schedule=False) for n in range(4)
    )
    _lost_with_its_worker(engine, lost.id)
    engine.leases.give_up(let_go.id, _lost_with_its_worker(engine, let_go.id).epoch, 60)
    claimed = engine.store.claim(drained.id, engine.owner, utcnow() + timedelta(seconds=30))
    assert claimed is not None
    guard = Guard(status=RunStatus.RUNNING, epoch=claimed.epoch)
    interrupt = Commit(status=RunStatus.INTERRUPTED, release_claim=True)
    assert engine.store.commit(claimed.run, guard, interrupt) is not None
    time.sleep(0.4)  # the queued one: longer than requeue_after
    assert len(engine.recover()) == 4
    reasons = {
        lost.id: "its execution was lost with its worker at step 0 (its claim expired)",
        let_go.id: "its worker let it go at step 0 (an outage, a lost lease or a shutdown)",
        drained.id: "it was interrupted (a drain, or a worker's time limit)",
        forgotten.id: "queued since ",
    }
    for run_id, why in reasons.items():
        assert f"run {run_id} requeued: {why}" in caplog.text


def test_recover_forgets_the_losses_of_runs_that_got_on_or_settled(
    make_any_engine: EngineFactory,
) -> None:
    # The count of losses in a row had a row per run ever lost, kept forever.
    agents = [Agent("a", ScriptedModel([text("ok")]))]
    engine = make_any_engine(agents, scheduler=ManualScheduler(), requeue_after=30.0)
    settled, moved_on, still = (
        engine.dispatch("a", trigger({"n": n}), schedule=False) for n in range(3)
    )
    for run in (settled, moved_on, still):
        _lost_with_its_worker(engine, run.id)
    assert sorted(engine.recover()) == sorted([settled.id, moved_on.id, still.id])
    assert engine.execute(settled.id).status is RunStatus.COMPLETED
    # Got on a step, and still running under a live claim.
    live = utcnow() + timedelta(seconds=engine.lease_ttl)
    claimed = engine.store.claim(moved_on.id, engine.owner, live)
    assert claimed is not None
    step = NewStep(kind="tool", name="t", started_at=utcnow(), finished_at=utcnow())
    guard = Guard(status=RunStatus.RUNNING, epoch=claimed.epoch)
    assert engine.store.commit(claimed.run, guard, Commit(steps=[step])) is not None

    def counted() -> list[str]:
        with engine.store.engine.connect() as conn:  # type: ignore[attr-defined]
            return sorted(conn.execute(sa.select(schema.crashes.c.run_id)).scalars())

    assert counted() == sorted([settled.id, moved_on.id, still.id])
    assert engine.recover() == []
    assert counted() == [still.id]  # queued at the step it was lost at: still counts
    assert engine.hold(still.id) == (1, None)  # queued: no hold now


class _Backlog(ManualScheduler):
    """Executions' nudges that wait in a queue for a free worker."""

    def __init__(self) -> None:
        super().__init__()
        self.in_line = 0

    def waiting(self) -> int | None:
        return self.in_line


def test_recover_leaves_queued_runs_to_the_nudges_still_in_line(
    make_engine: EngineFactory,
) -> None:
    # Behind a backlog every run queued longer than requeue_after was sent another
    # execution on every sweep: 400 runs in line made 2,532 messages.
    scheduler = _Backlog()
    engine = make_engine(
        [Agent("a", ScriptedModel([text("ok")]))], scheduler=scheduler, requeue_after=0.2
    )
    run = engine.dispatch("a", trigger({}))
    time.sleep(0.3)
    scheduler.in_line = 40
    assert engine.recover() == []
    scheduler.in_line = 0  # the line is gone and the run is still queued: its nudge was lost
    assert engine.recover() == [run.id]
    assert scheduler.scheduled == [run.id, run.id]


def test_recover_in_a_busy_embedded_engine_still_finds_a_run_whose_nudge_was_lost(
    make_engine: EngineFactory,
) -> None:
    # The local scheduler counted its running executions as nudges in line: while
    # any run executed, recover() left every lost one queued.
    release = threading.Event()

    @tool
    def slow() -> str:
        """Takes a while."""
        release.wait(10)
        return "done"

    model = ScriptedModel([tool_use("slow", {}), text("ok")])
    engine = make_engine([Agent("a", model, tools=[slow])], requeue_after=0.2)
    try:
        busy = engine.dispatch("a", trigger({"n": 1}))
        wait_for(lambda: engine.get_run(busy.id).status is RunStatus.RUNNING)
        lost = engine.dispatch("a", trigger({"n": 2}), schedule=False)
        time.sleep(0.3)
        assert engine.scheduler.waiting() == 0
        assert engine.recover() == [lost.id]
    finally:
        release.set()
    assert engine.idle(10)
    assert engine.get_run(lost.id).status is RunStatus.COMPLETED


def test_recover_nudges_only_the_first_queued_run_of_a_key(make_engine: EngineFactory) -> None:
    # Every queued run of a long line was requeued and sent an execution that could
    # claim nothing, on every sweep (50,000 in line: 89 s per recover()).
    engine = make_engine(
        [Agent("a", ScriptedModel([text("ok")]))], scheduler=ManualScheduler(), requeue_after=0.5
    )
    line = [engine.dispatch("a", trigger({"n": i}), concurrency_key="k") for i in range(5)]
    time.sleep(0.6)
    assert engine.recover() == [line[0].id]
    assert engine.scheduler.scheduled == [r.id for r in line] + [line[0].id]  # type: ignore[attr-defined]


def test_effect_tool_gets_a_stable_idempotency_key(make_engine: EngineFactory) -> None:
    keys: list[str] = []

    @tool(effect=True)
    def post(body: str, ctx: ToolContext) -> str:
        """Post something."""
        keys.append(ctx.idempotency_key)
        return "posted"

    model = ScriptedModel([tool_use("post", {"body": "hi"}), text("ok")])
    run = _run_to_end(make_engine([Agent("a", model, tools=[post])]))
    assert run.status is RunStatus.COMPLETED
    assert keys == [f"{run.id}:{model.calls[1][1]['content'][0]['id']}"]


def test_after_postgres_dropped_its_connections_the_next_dispatch_and_claim_go_through(
    make_engine: EngineFactory, db_url: str, errors: Errors
) -> None:
    # A restart (or an idle timeout) left every pooled connection dead: the first
    # statement to use one failed. A dispatch raised; an execution's claim failed,
    # and its run waited for recover() (in a worker, a minute or more).
    engine = make_engine([Agent("a", ScriptedModel([text("ok")]))], scheduler=ManualScheduler())
    warm = engine.dispatch("a", trigger({"n": 0}))
    assert engine.execute(warm.id).status is RunStatus.COMPLETED
    drop_connections(db_url)
    run = engine.dispatch("a", trigger({"n": 1}))
    assert run.status is RunStatus.QUEUED
    drop_connections(db_url)
    assert engine.execute(run.id).status is RunStatus.COMPLETED
    assert errors == []


def test_a_database_outage_while_recording_an_effect_aborts_the_execution_not_the_tool(
    make_engine: EngineFactory, db_url: str
) -> None:
    charged: list[str] = []
    cut: list[bool] = []
    away = contextlib.ExitStack()

    def cut_the_database_once(arguments: dict[str, Any], ctx: ToolContext) -> bool:
        # The server goes down just before the effect's intent is recorded (a drop
        # alone no longer does it: a connection the server ended is replaced).
        if not cut:
            cut.append(True)
            away.enter_context(database_away(db_url))
        return False

    @tool(effect=True, needs_approval=cut_the_database_once)
    def charge(amount: int, ctx: ToolContext) -> str:
        """Charge a card."""
        charged.append(ctx.idempotency_key)
        return "charged"

    model = ScriptedModel([tool_use("charge", {"amount": 5}), text("ok")])
    engine = make_engine([Agent("a", model, tools=[charge])], requeue_after=0.5)
    with away:
        run = engine.dispatch("a", trigger({}))
        assert engine.idle(20)
    # The execution stopped without settling (nothing it could not write is claimed)
    # and without telling the model the write failed; recovery finishes the run.
    assert engine.get_run(run.id).status is RunStatus.RUNNING
    assert charged == []
    wait_for(lambda: engine.recover() or None, "the run to be recovered")
    assert engine.idle(10)
    assert engine.get_run(run.id).status is RunStatus.COMPLETED
    assert len(charged) == 1
    results = [b for m in model.calls[-1] if isinstance(m["content"], list) for b in m["content"]]
    assert [b["content"] for b in results if b["type"] == "tool_result"] == ["charged"]


def test_embedded_default_runs_on_sqlite_with_local_leases(
    make_sqlite_engine: EngineFactory,
) -> None:
    model = ScriptedModel([tool_use("search_issues", {"query": "x"}), text("ok")])
    engine = make_sqlite_engine([Agent("a", model, tools=[search_issues])])
    runs = [engine.dispatch("a", trigger({"n": i})) for i in range(4)]
    assert engine.idle(20)
    assert all(engine.get_run(r.id).status is RunStatus.COMPLETED for r in runs)
    assert [s.kind for s in engine.steps(runs[0].id)] == ["llm", "tool", "llm"]
    here = engine.dispatch_here("a", trigger({"n": 9}), idempotency_key="here")
    assert here.status is RunStatus.COMPLETED
    assert engine.dispatch_here("a", trigger({"n": 9}), idempotency_key="here").id == here.id


def test_a_run_whose_agent_is_no_longer_registered_fails_with_unknown_agent(
    make_engine: EngineFactory,
) -> None:
    producer = make_engine(
        [Agent("gone", ScriptedModel([text("ok")]))], scheduler=ManualScheduler()
    )
    run = producer.dispatch("gone", trigger({}))
    worker = make_engine([Agent("other", ScriptedModel([text("ok")]))])
    failed = worker.execute(run.id)
    assert failed.status is RunStatus.FAILED
    assert failed.error is not None and failed.error.code == "unknown_agent"


def _without_input(body: dict[str, Any]) -> str:
    del body["content"][0]["input"]
    return json.dumps(body)


@pytest.mark.parametrize(
    ("store", "seq", "corrupt"),
    [
        ("postgres", 2, lambda body: '{"role": "assistant"}'),  # no content
        ("postgres", 1, _without_input),  # a call the model could not be sent again
        ("sqlite", 2, lambda body: "not JSON"),  # SQLite keeps any text
        # JSON, but no message: the last one was taken for one (internal_error).
        ("postgres", 2, lambda body: '"junk"'),
        ("sqlite", 2, lambda body: "[1, 2]"),
        ("postgres", 2, lambda body: "null"),
    ],
)
def test_a_corrupt_checkpoint_fails_the_run_and_the_engine_goes_on(
    request: pytest.FixtureRequest, store: str, seq: int, corrupt: Callable[[Any], str]
) -> None:
    make_engine = engines_on(request, store)
    model = ScriptedModel([tool_use("search_issues", {"query": "x"}), text("ok")], latency_s=0.2)
    engine = make_engine([Agent("a", model, tools=[search_issues])])
    run = engine.dispatch("a", trigger({}))
    wait_for(lambda: len(model.calls) == 2)
    engine.drain(timeout=5)
    where = "seq = :seq AND run_key = (SELECT key FROM agentruns_runs WHERE id = :id)"
    with engine.store.engine.begin() as conn:
        found = conn.execute(
            sa.text(f"SELECT body FROM agentruns_messages WHERE {where}"),
            {"seq": seq, "id": run.id},
        ).scalar_one()
        body = corrupt(json.loads(found) if isinstance(found, str) else found)
        conn.execute(
            sa.text(f"UPDATE agentruns_messages SET body = :body WHERE {where}"),
            {"body": body, "seq": seq, "id": run.id},
        )
    worker = make_engine([Agent("a", model, tools=[search_issues])])
    assert worker.recover() == [run.id]
    assert worker.idle(10)
    failed = worker.get_run(run.id)
    assert failed.status is RunStatus.FAILED
    assert failed.error is not None and failed.error.code == "invalid_checkpoint"
    assert worker.recover() == []  # failed once, not claimed again and again
    with contextlib.suppress(InvalidCheckpointError):  # a read says so, or reads it
        worker.checkpoint(run.id)
    healthy = worker.dispatch("a", trigger({"n": 2}))
    assert worker.idle(10)
    assert worker.get_run(healthy.id).status is RunStatus.COMPLETED


@pytest.mark.parametrize("store", ["postgres", "sqlite"])
@pytest.mark.parametrize(
    ("column", "damage"),
    [
        ("trigger", '{"payload": 1}'),
        ("budget", '{"max_steps": "many"}'),
        ("waiting", '{"kind": "approval"}'),
        # The execution failed internal_error (TypeError: cannot convert dictionary
        # update sequence...), for an agent with no state model too.
        ("state", "[1, 2]"),
        ("pending", '"text"'),
        ("pending", '{"call": 7}'),
    ],
)
def test_a_run_row_damaged_by_hand_is_read_listed_and_failed_once(
    request: pytest.FixtureRequest, store: str, column: str, damage: str
) -> None:
    _a_damaged_row_is_read_listed_and_failed_once(engines_on(request, store), column, damage)


@pytest.mark.parametrize("column", ["trigger", "budget", "waiting"])
def test_a_sqlite_run_row_whose_json_is_not_json_is_read_listed_and_failed_once(
    request: pytest.FixtureRequest, column: str
) -> None:
    # SQLite keeps JSON as text, which a hand edit can leave as anything: decoding
    # it failed every read of a list of runs (`agentruns runs`), not only that row.
    # (Postgres refuses such text.)
    _a_damaged_row_is_read_listed_and_failed_once(
        engines_on(request, "sqlite"), column, '{"nope": 1'
    )


def _a_damaged_row_is_read_listed_and_failed_once(
    make_engine: EngineFactory, column: str, damage: str
) -> None:
    agent = Agent("a", ScriptedModel([text("ok")]))
    producer = make_engine([agent], scheduler=ManualScheduler())
    damaged = producer.dispatch("a", trigger({"n": 1}), concurrency_key="k")
    behind = producer.dispatch("a", trigger({"n": 2}), concurrency_key="k")
    with producer.store.engine.begin() as conn:  # damaged outside agentruns
        conn.execute(
            sa.text(f"UPDATE agentruns_runs SET {column} = :value WHERE id = :id"),
            {"value": damage, "id": damaged.id},
        )
    # It reads (what cannot be, as empty) and is listed with the others.
    assert producer.get_run(damaged.id).status is RunStatus.QUEUED
    assert {r.id for r in producer.list_runs()} == {damaged.id, behind.id}

    worker = make_engine([agent])
    failed = worker.execute(damaged.id)
    assert failed.status is RunStatus.FAILED
    assert failed.error is not None and failed.error.code == "invalid_checkpoint"
    assert f"its {column} " in failed.error.message and "not a valid" in failed.error.message
    assert worker.get_run(damaged.id).status is RunStatus.FAILED
    assert worker.idle(10)  # its key is free: the run behind it was scheduled
    assert worker.get_run(behind.id).status is RunStatus.COMPLETED
    assert worker.recover() == []  # failed once, not claimed again and again


def test_a_run_row_with_a_status_agentruns_does_not_know_is_refused_clearly(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine([Agent("a", ScriptedModel([text("ok")]))], scheduler=ManualScheduler())
    odd, fine = (engine.dispatch("a", trigger({"n": n})) for n in (1, 2))
    with engine.store.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE agentruns_runs SET status = 'paused' WHERE id = :id"), {"id": odd.id}
        )
    with pytest.raises(InvalidCheckpointError, match="status agentruns does not know: 'paused'"):
        engine.get_run(odd.id)
    assert [r.id for r in engine.list_runs()] == [fine.id]  # the others still list


def test_token_budget_counts_cached_input_tokens(make_engine: EngineFactory) -> None:
    model = ScriptedModel(
        [tool_use("search_issues", {"query": "x"})],
        usage=Usage(input_tokens=5, cache_read_input_tokens=50, output_tokens=5),
    )
    agent = Agent("a", model, tools=[search_issues], budget=Budget(max_tokens=100))
    run = _run_to_end(make_engine([agent]))
    assert run.error is not None and run.error.code == "token_budget_exceeded"
    assert run.steps_used == 2


def test_executing_one_run_twice_at_once_runs_it_once(make_engine: EngineFactory) -> None:
    model = ScriptedModel([tool_use("search_issues", {"query": "x"}), text("ok")], latency_s=0.1)
    engine = make_engine([Agent("a", model, tools=[search_issues])], scheduler=ManualScheduler())
    run = engine.dispatch("a", trigger({}))
    barrier = threading.Barrier(2)
    results: list[Any] = []

    def go() -> None:
        barrier.wait()
        results.append(engine.execute(run.id))

    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert engine.get_run(run.id).status is RunStatus.COMPLETED
    assert len(model.calls) == 2
    assert [s.kind for s in engine.steps(run.id)] == ["llm", "tool", "llm"]


def test_only_the_tool_results_write_may_skip_the_wal_flush(make_engine: EngineFactory) -> None:
    # A model response, a pause or a settle is never lost to a database crash; the
    # tool results of a step may be (its tool calls then run again).
    model = ScriptedModel(
        [
            tool_use("search_issues", {"query": "a"}),
            [tool_use("search_issues", {"query": "b"}), tool_use("search_issues", {"query": "c"})],
            text("Done."),
        ]
    )
    engine = make_engine([Agent("triage", model, tools=[search_issues])])
    writes: list[Any] = []
    commit = engine.store.commit

    def recording(run: Any, guard: Any, write: Any) -> Any:
        writes.append(write)
        return commit(run, guard, write)

    engine.store.commit = recording  # type: ignore[method-assign]
    run = engine.dispatch("triage", trigger({}))
    assert engine.idle(10)
    assert engine.get_run(run.id).status is RunStatus.COMPLETED

    def answers_tools(write: Any) -> bool:
        return any(
            isinstance(m["content"], list)
            and any(b.get("type") == "tool_result" for b in m["content"])
            for m in write.messages
        )

    assert [answers_tools(w) for w in writes] == [False, True, False, True, False]
    assert [w.durable for w in writes] == [not answers_tools(w) for w in writes]


def test_dispatch_here_stores_the_run_claimed_and_executes_it_at_once(
    make_engine: EngineFactory,
) -> None:
    model = ScriptedModel([tool_use("search_issues", {"query": "a"}), text("Done.")])
    engine = make_engine([Agent("triage", model, tools=[search_issues])])
    statuses: list[str] = []
    engine.on("run.updated", lambda e: statuses.append(e.run.status.value if e.run else ""))

    run = engine.dispatch_here("triage", trigger({}), idempotency_key="here-1")
    assert run.status is RunStatus.COMPLETED and run.output == "Done."
    # Never seen queued: stored running (epoch 1) by the engine that executes it.
    assert statuses[0] == "running" and "queued" not in statuses
    # A duplicate finds the same run and does not execute it again.
    again = engine.dispatch_here("triage", trigger({}), idempotency_key="here-1")
    assert again.id == run.id and again.status is RunStatus.COMPLETED
    assert len(model.calls) == 2


def test_a_keyed_run_whose_turn_came_during_its_failed_claim_is_scheduled_again(
    make_engine: EngineFactory, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # B's claim sees older run A running; A completes, and the execution A's finish
    # schedules for B finds B's lease still held by that claim and does nothing.
    # Nothing else would schedule B: the failed claim must look again.
    scheduler = ManualScheduler()
    engine = make_engine([Agent("a", ScriptedModel([text("ok")]))], scheduler=scheduler)
    a = engine.dispatch("a", trigger({}), concurrency_key="k")
    b = engine.dispatch("a", trigger({}), concurrency_key="k")
    assert engine.store.claim(a.id, "elsewhere", utcnow() + timedelta(seconds=30))
    claim = engine.store.claim
    nudged: list[Run] = []

    def claim_as_a_finishes(run_id: str, *args: Any) -> Any:
        claimed = claim(run_id, *args)
        if run_id == b.id and not nudged:
            assert claimed is None  # A is running
            with psycopg.connect(db_url.replace("+psycopg", "")) as conn:
                conn.execute(
                    "UPDATE agentruns_runs SET status = 'completed' WHERE id = %s", (a.id,)
                )
            nudged.append(engine.execute(b.id))  # A's finish nudges B: its lease is held
        return claimed

    monkeypatch.setattr(engine.store, "claim", claim_as_a_finishes)
    scheduler.scheduled.clear()
    assert engine.execute(b.id).status is RunStatus.QUEUED
    assert nudged[0].status is RunStatus.QUEUED
    assert scheduler.scheduled == [b.id]  # looked again, and scheduled it
    assert engine.execute(b.id).status is RunStatus.COMPLETED


def test_dispatch_here_claims_a_keyed_run_in_turn(make_engine: EngineFactory) -> None:
    engine = make_engine(
        [Agent("triage", ScriptedModel([text("ok")]))], scheduler=ManualScheduler()
    )
    older = engine.dispatch("triage", trigger({}), concurrency_key="k")
    # An older run of the key is queued: this one is stored queued, for the caller to schedule.
    newer = engine.dispatch_here("triage", trigger({}), concurrency_key="k")
    assert newer.status is RunStatus.QUEUED
    assert engine.execute(older.id).status is RunStatus.COMPLETED
    assert engine.dispatch_here("triage", trigger({}), concurrency_key="k").status is (
        RunStatus.QUEUED  # the newer one is still first in line
    )
    assert engine.execute(newer.id).status is RunStatus.COMPLETED


def test_a_scripted_model_for_a_worker_keeps_no_transcripts(make_engine: EngineFactory) -> None:
    kept = ScriptedModel([tool_use("search_issues", {"query": "a"}), text("Done.")])
    lean = ScriptedModel(
        [tool_use("search_issues", {"query": "a"}), text("Done.")], keep_calls=False
    )
    engine = make_engine(
        [Agent("kept", kept, tools=[search_issues]), Agent("lean", lean, tools=[search_issues])]
    )
    runs = [engine.dispatch(name, trigger({})) for name in ("kept", "lean")]
    assert engine.idle(10)
    assert all(engine.get_run(r.id).output == "Done." for r in runs)
    assert [len(m) for m in kept.calls] == [1, 3] and lean.calls == []


def _stops_at(where: str) -> tuple[Agent, list[str]]:
    """An agent whose tool, effect tool, model or tool factory meets a Celery
    worker's time limit (``SoftTimeLimitExceeded``, as the prefork pool raises it)
    on the first execution only; what each call did, in order."""
    from celery.exceptions import SoftTimeLimitExceeded

    did: list[str] = []

    def limit(what: str) -> None:
        did.append(what)
        if what == where and did.count(what) == 1:
            raise SoftTimeLimitExceeded()

    @tool
    def look() -> str:
        """Look."""
        limit("look")
        return "seen"

    @tool(effect=True, on_unknown="fail")
    def pay(ctx: ToolContext) -> str:
        """Pay."""
        limit("pay")
        return "paid"

    responses = [tool_use("look", {}), tool_use("pay", {}), text("done")]

    def model(messages: list[dict[str, Any]]) -> Any:
        limit(f"model {len(messages)}")
        return responses[len(messages) // 2]

    def tools(ctx: Any) -> list[Any]:
        limit("tools")
        return [look, pay]

    agent = Agent("a", ScriptedModel(model), tools=tools)
    return agent, did


def _stopped_once(make_engine: EngineFactory, where: str) -> tuple[Engine, Run, list[str]]:
    """A run of ``_stops_at(where)``'s agent after its first execution."""
    agent, did = _stops_at(where)
    engine = make_engine([agent], scheduler=ManualScheduler())
    run = engine.dispatch("a", trigger({}))
    return engine, engine.execute(run.id), did


@pytest.mark.parametrize("where", ["look", "model 3", "pay"])
def test_a_workers_time_limit_leaves_the_run_interrupted_for_recover(
    make_engine: EngineFactory, errors: Errors, where: str
) -> None:
    # Raised wherever the task was, the worker's time limit failed the run: as the
    # model's error (model_error), the tool's (a tool error the model was told of,
    # though an effect may have happened) or the agent's code (internal_error).
    engine, stopped, did = _stopped_once(make_engine, where)
    assert stopped.status is RunStatus.INTERRUPTED and stopped.claim is None
    assert [s.error for s in engine.steps(stopped.id) if s.error] == []
    assert errors == []
    engine.recover()
    done = engine.execute(stopped.id)
    if where == "pay":  # its side effect may have happened: not called again blindly
        assert done.status is RunStatus.FAILED
        assert done.error is not None and done.error.code == "effect_outcome_unknown"
        return
    assert done.status is RunStatus.COMPLETED and done.output == "done"
    assert [s.error for s in engine.steps(done.id) if s.error] == []
    assert did.count("pay") == 1


@pytest.mark.parametrize("where", ["model 1", "tools"])
def test_a_workers_time_limit_before_anything_is_saved_fails_the_run(
    make_engine: EngineFactory, errors: Errors, where: str
) -> None:
    # Interrupted, a run whose model call (or tool) took longer than the limit was
    # stopped at the same point again after every recovery, a model call each time.
    engine, stopped, _ = _stopped_once(make_engine, where)
    assert stopped.status is RunStatus.FAILED and stopped.claim is None
    assert stopped.error is not None and stopped.error.code == "timeout"
    assert "task_time_limit" in stopped.error.message
    assert engine.get_run(stopped.id).status is RunStatus.FAILED
    assert errors == []


def test_a_workers_time_limit_just_after_the_last_write_leaves_the_run_as_written(
    make_engine: EngineFactory, errors: Errors
) -> None:
    # Raised just after the final write committed (here, by a listener of it), the
    # stop's own settle missed its guard: execute() returned the run as running,
    # reported a lost lease, and the key's next run was not scheduled.
    from celery.exceptions import SoftTimeLimitExceeded

    engine = make_engine([Agent("a", ScriptedModel([text("ok")]))], scheduler=ManualScheduler())

    def limit(event: Event) -> None:
        if event.run is not None and event.run.status is RunStatus.COMPLETED:
            raise SoftTimeLimitExceeded()

    engine.on("run.updated", limit)
    first = engine.dispatch("a", trigger({}), concurrency_key="k")
    second = engine.dispatch("a", trigger({}), concurrency_key="k")
    done = engine.execute(first.id)
    assert done.status is RunStatus.COMPLETED and done.output == "ok"
    assert errors == []
    assert engine.scheduler.scheduled.count(second.id) == 2  # type: ignore[attr-defined]


def test_a_claim_that_waited_past_its_lease_is_given_up_not_run_beside_its_recovery(
    make_engine: EngineFactory, db_url: str
) -> None:
    # The claim's expiry (and the lease) were set before its write waited for a lock;
    # once it went through, the claim had expired, another engine's recover() took
    # the run over, and both ran it: the effect twice. A claim that waited long is
    # now renewed before anything runs, and given up if it cannot be.
    calls: list[str] = []

    @tool(effect=True)
    def charge(ctx: ToolContext) -> str:
        """Charge."""
        calls.append(ctx.idempotency_key)
        time.sleep(0.5)
        return "charged"

    def agent() -> Agent:
        model = ScriptedModel([tool_use("charge", {}), text("done")])
        return Agent("a", model, tools=[charge])

    late = make_engine([agent()], scheduler=ManualScheduler(), lease_ttl=1.0)
    other = make_engine([agent()], scheduler=ManualScheduler(), lease_ttl=1.0)
    run = late.dispatch("a", trigger({}))
    with psycopg.connect(db_url.replace("+psycopg", "", 1)) as lock:
        lock.execute("SELECT 1 FROM agentruns_runs WHERE id = %s FOR UPDATE", (run.id,))
        claiming = threading.Thread(target=late.execute, args=(run.id,))
        claiming.start()
        time.sleep(1.5)  # the claim waits behind the lock, past its lease's TTL
    # It charges, or it gives the run up (and its execution ends).
    wait_for(lambda: calls or not claiming.is_alive() or None, "the late claim to act")
    assert other.recover() == [run.id]  # its claim expired: another engine takes it
    done = other.execute(run.id)
    claiming.join(10)
    assert done.status is RunStatus.COMPLETED
    assert late.get_run(run.id).status is RunStatus.COMPLETED
    assert len(calls) == 1


def test_recover_goes_past_a_run_another_session_holds_locked(
    make_engine: EngineFactory, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A worker cut off from Postgres in the middle of a write left its backend idle in
    # its transaction, holding the run's row until the server noticed (hours): every
    # sweep waited on it, and the lost runs behind it were never requeued.
    agents = [Agent("a", ScriptedModel([text("ok")]))]
    engine = make_engine(agents, scheduler=ManualScheduler())
    locked, other = (engine.dispatch("a", trigger({"n": n}), schedule=False) for n in range(2))
    for run in (locked, other):
        _lost_with_its_worker(engine, run.id)
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        with psycopg.connect(db_url.replace("+psycopg", "")) as holder:
            holder.execute("SELECT 1 FROM agentruns_runs WHERE id = %s FOR UPDATE", (locked.id,))
            holding.set()
            done.wait(15)  # (a bound, for the sweep that would wait it out)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(10)
        since = time.monotonic()
        assert engine.recover() == [other.id]
        assert time.monotonic() - since < 10
        assert f"recover: run {locked.id} is locked by another session" in caplog.text
    finally:
        done.set()
        holder.join()
    assert engine.recover() == [locked.id]  # let go: the next sweep takes it


def test_every_error_pickles_whole() -> None:
    # A prefork worker's process pickles a task's error to its main process: unpickled,
    # UnknownAgentError said its message twice, a token's reason was its whole message,
    # a ModelError lost its usage and a NotifierError did not unpickle at all.
    import pickle

    from agentruns import errors
    from agentruns.models.base import ModelError

    usage = Usage(input_tokens=3, output_tokens=4)
    made = [
        errors.LeaseLostError("r1"),
        errors.InvalidTokenError("expired", "it expired at noon"),
        errors.InvalidTokenError("malformed"),
        errors.UnknownAgentError("nobody"),
        errors.RunNotFoundError("r2"),
        errors.NotRetryableError("r3", "run r3 is completed"),
        errors.NotifierError("r4", ValueError("the pager is down")),
        errors.InvalidSettingError("AGENTRUNS_SLOTS must be a number"),
        errors.InvalidAnswerError("approved must be a bool"),
        ModelError("overloaded", usage),
    ]
    for exc in made:
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc)
        assert (str(back), back.args, vars(back)) == (str(exc), exc.args, vars(exc))
