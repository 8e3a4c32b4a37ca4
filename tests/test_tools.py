"""Tools as ``@tool`` makes them: their schemas, how they are called, what their results
may be; and the agent arguments checked where they are given. Runs are on the real
Postgres and Redis."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Annotated, Any

import pytest
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    model_validator,
)

from agentruns import Agent, Engine, RunStatus, ToolContext, tool
from agentruns.models import ScriptedModel, text, tool_use
from agentruns.tools import StateHolder, state_tools
from tests.conftest import EngineFactory, trigger


def _results(model: ScriptedModel) -> list[dict[str, Any]]:
    """The tool results the model was given, in order."""
    return [
        block
        for message in model.calls[-1]
        if isinstance(message["content"], list)
        for block in message["content"]
        if block["type"] == "tool_result"
    ]


def _run(make_engine: EngineFactory, agent: Agent) -> Any:
    engine = make_engine([agent])
    run = engine.dispatch(agent.name, trigger({}))
    assert engine.idle(10)
    return engine.get_run(run.id)


def test_annotated_constraints_and_descriptions_reach_the_schema_and_are_enforced(
    make_engine: EngineFactory,
) -> None:
    called: list[int] = []

    @tool
    def pick(limit: Annotated[int, Field(ge=1, le=10, description="how many")]) -> str:
        """Pick some."""
        called.append(limit)
        return "picked"

    schema = pick.spec.input_schema["properties"]["limit"]
    assert (schema["minimum"], schema["maximum"], schema["description"]) == (1, 10, "how many")
    model = ScriptedModel([tool_use("pick", {"limit": 500}), text("done")])
    assert _run(make_engine, Agent("a", model, tools=[pick])).status is RunStatus.COMPLETED
    assert called == [] and _results(model)[0]["is_error"] is True


def test_parameters_a_json_object_cannot_fill_are_refused_when_the_tool_is_made() -> None:
    def star_args(*items: int) -> None: ...
    def star_kwargs(**fields: int) -> None: ...
    def positional_only(a: int, /) -> None: ...
    def private_name(_id: int) -> None: ...

    for fn in (star_args, star_kwargs, positional_only, private_name):
        with pytest.raises(TypeError, match="parameter"):
            tool(fn)


def test_a_tool_name_the_messages_api_refuses_is_refused_when_the_tool_is_made() -> None:
    # Else every run offering it failed at its first model call, with the API's 400.
    def café(q: str) -> str: ...
    def ok(q: str) -> str: ...

    for make in (
        lambda: tool(café),
        lambda: tool(name="search.issues")(ok),
        lambda: tool(name="s" * 129)(ok),
    ):
        with pytest.raises(ValueError, match="not one the Messages API takes"):
            make()
    assert tool(name="search-issues_2")(ok).name == "search-issues_2"
    assert tool(name="s" * 128)(ok).spec.name == "s" * 128


def test_the_context_is_recognised_also_as_an_optional_parameter() -> None:
    @tool
    def post(body: str, ctx: ToolContext | None = None) -> str:
        """Post."""
        return "posted"

    assert list(post.spec.input_schema["properties"]) == ["body"]


def test_an_async_tool_runs_to_its_end(make_engine: EngineFactory) -> None:
    @tool
    async def fetch(url: str) -> str:
        """Fetch a page."""
        await asyncio.sleep(0.01)
        return f"fetched {url}"

    model = ScriptedModel([tool_use("fetch", {"url": "u"}), text("done")])
    assert _run(make_engine, Agent("a", model, tools=[fetch])).status is RunStatus.COMPLETED
    assert _results(model)[0]["content"] == "fetched u"


def test_a_tool_raising_a_base_exception_is_a_tool_error_and_the_run_goes_on(
    make_engine: EngineFactory,
) -> None:
    @tool
    def fetch() -> str:
        """Fetch, cancelled underneath (asyncio.CancelledError is a BaseException)."""
        raise asyncio.CancelledError()

    model = ScriptedModel([tool_use("fetch", {}), text("done")])
    assert _run(make_engine, Agent("a", model, tools=[fetch])).status is RunStatus.COMPLETED
    assert _results(model)[0]["is_error"] is True


@pytest.mark.parametrize(
    "result",
    [{"v": float("nan")}, [float("inf")], b"report-\xff.txt".decode(errors="surrogateescape")],
)
def test_a_result_no_store_can_keep_as_json_is_the_tools_error(
    make_engine: EngineFactory, result: Any
) -> None:
    @tool
    def measure() -> Any:
        """Measure."""
        return result

    model = ScriptedModel([tool_use("measure", {}), text("done")])
    assert _run(make_engine, Agent("a", model, tools=[measure])).status is RunStatus.COMPLETED
    (answer,) = _results(model)
    assert answer["is_error"] is True and "cannot be stored as JSON" in answer["content"]


def test_agent_arguments_of_the_wrong_type_are_refused_when_the_agent_is_made() -> None:
    model = ScriptedModel([text("ok")])
    assert Agent("a", model, budget={"max_steps": 3}).budget.max_steps == 3
    with pytest.raises(TypeError, match="budget"):
        Agent("a", model, budget="3 steps")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="approval_ttl"):
        Agent("a", model, approval_ttl=3600)  # type: ignore[arg-type]
    # "Never expires" would overflow the expiry date only when a run pauses.
    for ttl in (timedelta.max, timedelta(0), timedelta(seconds=-1)):
        with pytest.raises(ValueError, match="approval_ttl must be positive"):
            Agent("a", model, approval_ttl=ttl)
    assert Agent("a", model, approval_ttl=timedelta(minutes=5)).approval_ttl.seconds == 300


def test_agent_and_tool_definitions_that_would_fail_every_run_are_refused_when_made() -> None:
    # Each was taken, then failed every run (internal_error, model_error), every
    # dispatch (an InvalidTriggerError about the agent), every tick (NotifierError),
    # or was quietly taken for something else (a needs_approval of "no" asked).
    model = ScriptedModel([text("ok")])

    class Notes(BaseModel):
        text: str = ""

    @tool
    def read_state() -> str:
        """Shadows the state tool."""
        return ""

    def look() -> str:
        """Look."""
        return ""

    refused: list[tuple[Callable[[], Any], type[Exception], str]] = [
        (lambda: Agent("a", None), TypeError, "model must be a Model"),  # type: ignore[arg-type]
        (lambda: Agent("a", "claude"), TypeError, "model must be a Model"),  # type: ignore[arg-type]
        (lambda: Agent("a", model, instructions=5), TypeError, "instructions are text"),  # type: ignore[arg-type]
        (lambda: Agent("a", model, tools=[look, tool(look)]), ValueError, "two tools named 'look'"),
        (lambda: Agent("a", model, tools=[read_state], state=Notes), ValueError, "read_state"),
        (lambda: Agent("a", model, tools=[42]), TypeError, "a tool is a function, not 42"),  # type: ignore[list-item]
        (lambda: Agent("a", model, tools="look"), TypeError, "tools are a list"),  # type: ignore[arg-type]
        (lambda: Agent("a", model, state=dict), TypeError, "state must be a pydantic model"),  # type: ignore[arg-type]
        (lambda: Agent("a", model, concurrency_key=""), TypeError, "concurrency_key"),
        (lambda: Agent("a", model, concurrency_key=5), TypeError, "concurrency_key"),  # type: ignore[arg-type]
        (lambda: Agent("a", model, notifier="x"), TypeError, "notifier must be a function"),  # type: ignore[arg-type]
        (lambda: tool(needs_approval="no")(look), TypeError, "needs_approval must be"),  # type: ignore[call-overload]
        (lambda: tool(on_unknown="fail")(look), ValueError, "add effect=True"),
        (lambda: tool(effect="yes")(look), TypeError, "effect must be True or False"),  # type: ignore[call-overload]
        (lambda: tool(42), TypeError, "a tool is a function, not 42"),  # type: ignore[call-overload]
        (lambda: Engine("sqlite:///nowhere.db", agents=["x"]), TypeError, "Agent objects, not 'x'"),  # type: ignore[list-item]
    ]
    for make, error, said in refused:
        with pytest.raises(error, match=re.escape(said)):
            make()
    # What is fine stays fine (the first version refused some of these).
    Agent("a", model, tools=[look], state=Notes, concurrency_key="k", notifier=print)
    Agent("a", model, tools=lambda ctx: [look, look])  # a function's tools: checked per run
    tool(effect=True, on_unknown="fail", needs_approval=lambda args, ctx: True)(look)
    registry = {"look": look}
    for tools in (registry.values(), {look}, (t for t in [look])):
        assert [t.name for t in Agent("a", model, tools=tools).tools_for(None)] == ["look"]  # type: ignore[arg-type]
    assert Agent("a", model, instructions=None).system_prompt(None) == ""  # type: ignore[arg-type]
    assert tool(effect=1)(look).effect is True  # type: ignore[call-overload]


def test_an_agent_name_no_store_holds_as_it_is_is_refused_when_the_agent_is_made(
    make_any_engine: EngineFactory,
) -> None:
    # Taken, each failed its runs later, and differently on Postgres (a truncation,
    # a ValueError, a UnicodeEncodeError) and SQLite.
    model = ScriptedModel([text("ok")])
    for name in ("L" * 201, "n\x00ul", "esc\x1b[2J", "tab\there", "   ", " a", "a\n", "s\ud800"):
        with pytest.raises(ValueError, match="an agent's name"):
            Agent(name, model)
    longest = "é" * 200
    assert _run(make_any_engine, Agent(longest, model)).agent == longest
    assert _run(make_any_engine, Agent("triage bot", model)).status is RunStatus.COMPLETED


def test_a_run_that_cannot_start_its_execution_fails_instead_of_staying_running(
    make_engine: EngineFactory,
) -> None:
    agent = Agent("a", ScriptedModel([text("ok")]))
    agent.budget = "broken after it was made"  # type: ignore[assignment]
    run = _run(make_engine, agent)
    assert run.status is RunStatus.FAILED and run.claim is None
    assert run.error is not None and run.error.code == "internal_error"


class Ticket(BaseModel):
    assignee: str | None = None
    item_count: int = Field(0, alias="itemCount")


def test_update_state_clears_an_optional_field_and_sets_an_aliased_one(
    make_engine: EngineFactory,
) -> None:
    model = ScriptedModel(
        [
            tool_use("update_state", {"assignee": "bob", "item_count": 5}),
            tool_use("update_state", {"assignee": None}),
            text("done"),
        ]
    )
    engine = make_engine([Agent("a", model, state=Ticket)])
    run = engine.dispatch("a", trigger({}))
    assert engine.idle(10)
    checkpoint = engine.checkpoint(run.id)
    assert checkpoint is not None and checkpoint.state == {"assignee": None, "item_count": 5}


class Counted(BaseModel):
    note: str | None = None
    count: int = Field(0, ge=0, description="items seen")
    low: int = 0
    high: int = 10

    @model_validator(mode="after")
    def _ordered(self) -> Counted:
        if self.low > self.high:
            raise ValueError("low must not pass high")
        return self


def test_update_state_offers_null_only_for_fields_whose_type_takes_it(
    make_engine: EngineFactory,
) -> None:
    # Every field was offered as nullable, and a null for one that is not failed in
    # pydantic's words, over several lines with a link.
    model = ScriptedModel(
        [
            tool_use("update_state", {"count": None}),
            tool_use("update_state", {"low": 11}),
            tool_use("update_state", {"note": None, "count": 2}),
            text("done"),
        ]
    )
    update = state_tools(Counted, StateHolder({}))[1]
    properties = update.spec.input_schema["properties"]
    assert properties["count"] == {
        "description": "items seen",
        "minimum": 0,
        "title": "Count",
        "type": "integer",
    }
    assert "anyOf" in properties["note"] and "required" not in update.spec.input_schema
    engine = make_engine([Agent("a", model, state=Counted)])
    run = engine.dispatch("a", trigger({}))
    assert engine.idle(10)
    results = [m for m in model.calls[-1] if m["role"] == "user"][1:]
    said = [r["content"][0] for r in results]
    assert said[0]["is_error"] and "count: Input should be a valid integer" in said[0]["content"]
    assert said[1]["is_error"] and "low must not pass high" in said[1]["content"]
    assert all(
        "\n" not in s["content"] and "errors.pydantic.dev" not in s["content"] for s in said[:2]
    )
    checkpoint = engine.checkpoint(run.id)
    assert checkpoint is not None and checkpoint.state == {
        "note": None,
        "count": 2,
        "low": 0,
        "high": 10,
    }


def _to_cents(value: Any) -> int:
    return int(Decimal(str(value)) * 100)


def _with_unit(value: str, info: ValidationInfo) -> str:
    unit = info.data["unit"]
    return value if value.endswith(unit) else f"{value} {unit}"


class Priced(BaseModel):
    unit: str = "kg"
    # Inside the type (in a union), the validators are part of the field's annotation.
    price_cents: Annotated[int, BeforeValidator(_to_cents)] | None = 0
    weight: Annotated[str, AfterValidator(_with_unit)] | None = "0 kg"


def test_update_state_applies_the_states_validators_once_to_the_merged_state(
    make_engine: EngineFactory,
) -> None:
    # Applied to the tool's input too, a field's validator ran twice (5 became 50000
    # cents), and one reading another field saw the fields left out as None.
    model = ScriptedModel(
        [
            tool_use("update_state", {"weight": "3"}),
            tool_use("update_state", {"price_cents": 5}),
            text("done"),
        ]
    )
    engine = make_engine([Agent("a", model, state=Priced)])
    run = engine.dispatch("a", trigger({}))
    assert engine.idle(10)
    assert engine.get_run(run.id).status is RunStatus.COMPLETED
    checkpoint = engine.checkpoint(run.id)
    assert checkpoint is not None
    assert checkpoint.state == {"unit": "kg", "price_cents": 500, "weight": "3 kg"}


class Strict(BaseModel):
    model_config = ConfigDict(strict=True)
    due: datetime | None = None
    count: int = 0


def test_a_strict_states_datetime_is_taken_again_on_the_next_update(
    make_engine: EngineFactory,
) -> None:
    # Kept as JSON text and validated again as Python, it refused every later update.
    model = ScriptedModel(
        [
            tool_use("update_state", {"due": "2026-12-24T18:00:00Z"}),
            tool_use("update_state", {"count": 2}),
            text("done"),
        ]
    )
    engine = make_engine([Agent("a", model, state=Strict)])
    run = engine.dispatch("a", trigger({}))
    assert engine.idle(10)
    results = [m for m in model.calls[-1] if m["role"] == "user"][1:]
    assert not any(r["content"][0].get("is_error") for r in results), results
    checkpoint = engine.checkpoint(run.id)
    assert checkpoint is not None
    assert checkpoint.state == {"due": "2026-12-24T18:00:00Z", "count": 2}
