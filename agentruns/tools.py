"""Tools: the ``@tool`` decorator, their input schemas, and the context a tool is called with."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import (
    Annotated,
    Any,
    Literal,
    Union,
    get_args,
    get_origin,
    get_type_hints,
    overload,
)

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SkipValidation,
    ValidationError,
    create_model,
)
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from agentruns.errors import problems
from agentruns.models.base import ToolSpec
from agentruns.runs import Run

# What the Messages API takes as a tool's name (its docs have said 64 characters at
# most, its errors 128: the looser, so no name it takes is refused here).
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")

OnUnknown = Literal["retry", "approve", "fail"]
NeedsApproval = bool | Callable[[dict[str, Any], "ToolContext"], bool]


@dataclass(frozen=True)
class ToolContext:
    """What a tool may know about the call it serves.

    ``idempotency_key`` is stable across re-executions of the same call, so
    an outside system can deduplicate a side effect the engine could not record.
    """

    run: Run
    tool_call_id: str
    idempotency_key: str
    signal: threading.Event


class ToolInputError(Exception):
    """The model passed arguments that don't fit the tool's schema."""


class Tool:
    """A function the model may call, with its schema and how the engine must treat it."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        effect: bool = False,
        needs_approval: NeedsApproval = False,
        on_unknown: OnUnknown = "retry",
        input_model: type[BaseModel] | None = None,
        partial: bool = False,
    ) -> None:
        # Checked here: a wrong one would otherwise fail, or be ignored, on every run.
        if not callable(fn):
            raise TypeError(f"a tool is a function, not {fn!r}")
        if on_unknown not in ("retry", "approve", "fail"):
            raise ValueError(f"on_unknown must be retry, approve or fail, not {on_unknown!r}")
        if not isinstance(effect, int):  # True, False, or 1 and 0
            raise TypeError(f"effect must be True or False, not {effect!r}")
        effect = bool(effect)
        if on_unknown != "retry" and not effect:
            # Only an effect tool's call is recorded, and so can have an unknown outcome.
            raise ValueError(f"on_unknown={on_unknown!r} is for effect tools: add effect=True")
        if not isinstance(needs_approval, bool) and not callable(needs_approval):
            raise TypeError(
                "needs_approval must be True, False or a function of (arguments, ctx),"
                f" not {needs_approval!r}"
            )
        if description is not None and not isinstance(description, str):
            raise TypeError(f"a tool's description is text, not {description!r}")
        self.fn = fn
        self.name = name or fn.__name__
        if not isinstance(self.name, str) or not _TOOL_NAME.fullmatch(self.name):
            # Else the first request that offers it fails, with the run, at the API.
            raise ValueError(
                f"tool name {self.name!r} is not one the Messages API takes: 1 to 128"
                " ASCII letters, digits, '_' or '-'"
            )
        self.description = description or inspect.getdoc(fn) or self.name
        self.effect = effect
        self.needs_approval = needs_approval
        self.on_unknown: OnUnknown = on_unknown
        self._ctx_param: str | None = None
        self.partial = partial
        # An async tool runs to its end in the calling thread (no loop runs there).
        self._coroutine = inspect.iscoroutinefunction(fn)
        self.input_model = input_model or self._model_from_signature(fn)
        self.spec = ToolSpec(
            name=self.name,
            description=self.description,
            input_schema=self.input_model.model_json_schema(),
        )

    def _model_from_signature(self, fn: Callable[..., Any]) -> type[BaseModel]:
        # With extras: Annotated[int, Field(ge=1, description=...)] keeps its Field.
        hints = get_type_hints(fn, include_extras=True)
        fields: dict[str, Any] = {}
        for param in inspect.signature(fn).parameters.values():
            annotation = hints.get(param.name, Any)
            if _is_context(annotation):
                self._ctx_param = param.name
                continue
            # The model's arguments are a JSON object, passed by keyword.
            if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
                raise TypeError(
                    f"tool {self.name}: parameter {param} cannot take a named argument; "
                    "a tool's parameters are named, one per field of its input"
                )
            if param.name.startswith("_"):
                raise TypeError(
                    f"tool {self.name}: parameter {param.name} starts with '_', which "
                    "pydantic keeps out of the input schema; rename it"
                )
            default = ... if param.default is inspect.Parameter.empty else param.default
            fields[param.name] = (annotation, default)
        return create_model(
            f"{self.name}_input",
            __config__=ConfigDict(extra="forbid"),
            **fields,
        )

    def validate(self, arguments: Any) -> dict[str, Any]:
        """The arguments the function is called with (``partial``: only those given)."""
        if not isinstance(arguments, dict):
            raise ToolInputError(f"arguments of {self.name} must be an object")
        try:
            parsed = self.input_model.model_validate(arguments)
        except ValidationError as exc:
            said = problems(exc, "input")
            raise ToolInputError(f"invalid arguments for {self.name}: {said}") from None
        names = parsed.model_fields_set if self.partial else type(parsed).model_fields
        return {name: getattr(parsed, name) for name in names}

    def requires_approval(self, arguments: dict[str, Any], ctx: ToolContext) -> bool:
        if callable(self.needs_approval):
            return bool(self.needs_approval(arguments, ctx))
        return bool(self.needs_approval)

    def __call__(self, arguments: dict[str, Any], ctx: ToolContext) -> Any:
        kwargs = dict(arguments)
        if self._ctx_param is not None:
            kwargs[self._ctx_param] = ctx
        if self._coroutine:
            return asyncio.run(self.fn(**kwargs))
        return self.fn(**kwargs)

    def __repr__(self) -> str:
        return f"Tool({self.name!r}, effect={self.effect})"


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    effect: bool = False,
    needs_approval: NeedsApproval = False,
    on_unknown: OnUnknown = "retry",
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    effect: bool = False,
    needs_approval: NeedsApproval = False,
    on_unknown: OnUnknown = "retry",
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a function a tool; its docstring is the description, its type hints the schema."""

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(
            f,
            name=name,
            description=description,
            effect=effect,
            needs_approval=needs_approval,
            on_unknown=on_unknown,
        )

    return wrap(fn) if fn is not None else wrap


def as_tool(value: Tool | Callable[..., Any]) -> Tool:
    return value if isinstance(value, Tool) else Tool(value)


def result_content(value: Any) -> tuple[Any, str]:
    """A tool's return value as (JSON value for the step row, text for the model).

    Raises ValueError for what no store keeps as JSON (NaN, infinities, text that is
    not UTF-8): the model then gets that as the tool's error."""
    jsonable = to_jsonable_python(value)
    try:
        json.dumps(jsonable, allow_nan=False, ensure_ascii=False).encode()
    except ValueError as exc:
        raise ValueError(f"the result cannot be stored as JSON: {exc}") from None
    text = jsonable if isinstance(jsonable, str) else json.dumps(jsonable, sort_keys=True)
    return jsonable, text


def _is_context(annotation: Any) -> bool:
    """``ToolContext``, also as ``ToolContext | None`` or inside ``Annotated``."""
    if annotation is ToolContext:
        return True
    if get_origin(annotation) is Annotated:
        return _is_context(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        return any(_is_context(arg) for arg in get_args(annotation) if arg is not type(None))
    return False


STATE_TOOL_NAMES = ["read_state", "update_state"]  # ``state_tools``'s


def _schema_only(field: FieldInfo) -> Any:
    """A state field's type as ``update_state``'s input has it: its schema, with
    nothing of it applied."""
    typed = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    skip: Any = SkipValidation  # typed as a generic alias, which mypy cannot index here
    return skip[typed]


def _left_out() -> None:
    """An ``update_state`` field's default: not in the schema, and never used, as only
    the fields given are (``model_fields_set``)."""


def state_tools(state_model: type[BaseModel], holder: StateHolder) -> list[Tool]:
    """``read_state`` and ``update_state`` over an agent's pydantic state."""

    def read_state() -> dict[str, Any]:
        return holder.value

    def update_state(**changes: Any) -> dict[str, Any]:
        # Only the fields given (a null clears an optional one), by field name.
        merged = {**holder.value, **changes}
        try:
            # From JSON, as the state is kept (and the model sends its input): a strict
            # state's datetime, kept as text, is then taken again.
            new = state_model.model_validate_json(
                json.dumps(merged, ensure_ascii=False), by_name=True, by_alias=False
            )
        except ValidationError as exc:  # the state's own validators: said in one line
            raise ValueError(f"the state would not be valid: {problems(exc, 'state')}") from None
        holder.value = new.model_dump(mode="json")
        return holder.value

    # Every field may be left out, and is then left as it is (``partial``). Its
    # schema is the state's field's (null only where its type takes it, constraints
    # and description kept), but nothing of it is applied to the input: the state
    # applies its validators once, to the merged whole (applied to the input too,
    # they ran twice, and saw the fields left out as None).
    update_fields: dict[str, Any] = {
        name: (
            _schema_only(field),
            Field(default_factory=_left_out, description=field.description),
        )
        for name, field in state_model.model_fields.items()
    }
    update_model = create_model(
        "update_state_input", __config__=ConfigDict(extra="forbid"), **update_fields
    )
    read_model = create_model("read_state_input", __config__=ConfigDict(extra="forbid"))
    return [
        Tool(
            read_state,
            description="Read the agent's saved state; returns it as a JSON object.",
            input_model=read_model,
        ),
        Tool(
            update_state,
            description="Merge the given fields into the agent's saved state; returns it.",
            input_model=update_model,
            partial=True,
        ),
    ]


class StateHolder:
    """The agent state of one execution, written with the next checkpoint."""

    def __init__(self, value: dict[str, Any]) -> None:
        self.value = value
