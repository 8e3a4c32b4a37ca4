"""What a caller hands the engine, checked before anything is stored or read: the
run a dispatch stores, a run's id, how many runs a read may return."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from agentruns.agent import Agent
from agentruns.errors import InvalidTriggerError, RunNotFoundError, UnknownAgentError, problems
from agentruns.runs import (
    Budget,
    Run,
    TriggerEnvelope,
    is_storable_key,
    is_utf8,
    keys_not_text,
    with_text_keys,
)
from agentruns.store.base import NewRun
from agentruns.store.schema import KEY_LENGTH, THREAD_KEY

log = logging.getLogger("agentruns")

# The most runs one read returns (SQLite and Postgres both take it as a LIMIT).
MAX_LIMIT = 1_000_000_000


def new_run(
    agents: Mapping[str, Agent],
    agent: str | Agent,
    trigger: TriggerEnvelope | dict[str, Any],
    idempotency_key: str | None,
    concurrency_key: str | None,
    thread: str | None,
    budget: Budget | dict[str, Any] | None,
) -> NewRun:
    """The run a dispatch of ``agent`` (one of ``agents``) stores, or the error its
    input gets (storing nothing)."""
    name = agent.name if isinstance(agent, Agent) else agent
    found = agents.get(name)
    if found is None:
        raise UnknownAgentError(name)
    envelope = trigger_envelope(trigger)
    idempotency_key, concurrency_key, thread = _keys(
        found, envelope, idempotency_key, concurrency_key, thread
    )
    return NewRun(
        id=str(uuid.uuid4()),
        agent=name,
        trigger=envelope,
        idempotency_key=idempotency_key,
        concurrency_key=concurrency_key,
        thread=thread,
        budget=_limits(found.budget, budget),
    )


def check_dispatch(
    trigger: TriggerEnvelope | dict[str, Any],
    idempotency_key: str | None = None,
    concurrency_key: str | None = None,
    thread: str | None = None,
    budget: Budget | dict[str, Any] | None = None,
) -> None:
    """What a dispatch's worker would refuse whatever its agent (``InvalidTriggerError``),
    refused where it is sent: a message the worker refuses is a request lost, said
    only in the worker's log."""
    _keys(None, trigger_envelope(trigger), idempotency_key, concurrency_key, thread)
    check_budget(budget)


def check_budget(budget: Budget | dict[str, Any] | None) -> None:
    """``InvalidTriggerError`` for a budget no run could be given."""
    if budget is not None:
        _replaced(Budget(), budget)


def _limits(agent: Budget, budget: Budget | dict[str, Any] | None) -> Budget | None:
    """A run's own budget: the agent's, with the limits a dispatch names replaced."""
    return None if budget is None else _replaced(agent, budget)


def retried_budget(
    agents: Mapping[str, Agent], run: Run, budget: Budget | dict[str, Any]
) -> Budget:
    """The budget a retry gives ``run``: the one it ran with (its own, else its agent's),
    with the limits ``budget`` names replaced."""
    base = run.budget
    if base is None:
        found = agents.get(run.agent)
        if found is None:  # its budget is the agent's, which this engine does not know
            raise UnknownAgentError(run.agent)
        base = found.budget
    return _replaced(base, budget)


def _replaced(base: Budget, budget: Budget | dict[str, Any]) -> Budget:
    try:
        given = Budget.model_validate(budget)
    except ValidationError as exc:
        raise InvalidTriggerError(f"invalid budget: {problems(exc, 'budget')}") from None
    return base.model_copy(update=given.model_dump(exclude_unset=True))


def _keys(
    agent: Agent | None,
    envelope: TriggerEnvelope,
    idempotency_key: str | None,
    concurrency_key: str | None,
    thread: str | None,
) -> tuple[str | None, str | None, str | None]:
    """A run's idempotency key, concurrency key and thread: as given, else from the
    trigger (its id, its thread) and the agent (its key, unless no ``agent`` is
    given: a check where a dispatch is sent); checked."""
    if concurrency_key is None and agent is not None:
        # The agent's key is checked as one given to dispatch is: "" refused too.
        concurrency_key = agent.key_for(envelope)
    for what, text in (
        ("idempotency_key", idempotency_key),
        ("concurrency_key", concurrency_key),
        ("thread", thread),
    ):
        if text is not None and not (isinstance(text, str) and is_utf8(text)):
            raise InvalidTriggerError(f"{what} must be UTF-8 text, not {text!r}")
    thread = thread if thread is not None else envelope.thread
    for what, text in (
        ("idempotency_key", idempotency_key)
        if idempotency_key is not None
        else ("the trigger's id (the idempotency key by default)", envelope.id),
        ("concurrency_key", concurrency_key),
        ("thread", thread),
    ):
        if text == "":  # an unset variable, likely: it would make every run one
            raise InvalidTriggerError(f"{what} must not be empty (leave it out for none)")
    for what, text in (("source", envelope.source), ("name (trigger)", envelope.trigger)):
        if text == "":  # an unset variable, likely: shown as "/ manual", or the like
            raise InvalidTriggerError(f"the trigger's {what} must not be empty")
    if concurrency_key is None and thread is not None:
        concurrency_key = f"{THREAD_KEY}{thread}"
    if idempotency_key is None:
        idempotency_key = envelope.id
    for what, text, room in (
        # A thread's name is also its runs' concurrency key, after "thread:".
        ("thread", thread, KEY_LENGTH - len(THREAD_KEY)),
        ("idempotency_key", idempotency_key, KEY_LENGTH),
        ("concurrency_key", concurrency_key, KEY_LENGTH),
    ):
        if text is not None and len(text) > room:
            raise InvalidTriggerError(f"{what} is {len(text)} characters long; at most {room} fit")
        if text is not None and "\x00" in text:
            raise InvalidTriggerError(f"{what} must not hold a NUL character: {text!r}")
    return idempotency_key, concurrency_key, thread


def trigger_envelope(trigger: TriggerEnvelope | dict[str, Any]) -> TriggerEnvelope:
    if isinstance(trigger, TriggerEnvelope):
        # Validated again: its fields may have been changed (or never checked) since.
        trigger = trigger.model_dump()
    if not isinstance(trigger, dict):
        raise InvalidTriggerError("a trigger is a TriggerEnvelope or a dict of its fields")
    try:
        envelope = TriggerEnvelope.model_validate(trigger)
    except ValidationError as exc:
        raise InvalidTriggerError(f"invalid trigger: {problems(exc, 'trigger')}") from None
    if keys_not_text(envelope.payload):
        # As JSON spells them (1 as "1", None as "null"), as a Celery message brings
        # them: else stored as pydantic spells them ("None"), and the model shown
        # JSON's, one run of two payloads. (Here, not in the model's validator, which
        # every read of a run would pay for.)
        try:
            payload = with_text_keys(envelope.payload)
        except ValueError as exc:
            raise InvalidTriggerError(f"invalid trigger: {exc}") from None
        envelope = envelope.model_copy(update={"payload": payload})
    return envelope


def warn_if_another(run: Run, new: NewRun) -> None:
    """A dispatch whose idempotency key names a run of another agent, or of another
    payload, returns that run (SPEC): said, since one trigger sent to two agents
    under its own id as the key starts only the first."""
    payload = new.trigger.model_dump(mode="json")["payload"]  # as stored: a tuple is a list
    if run.agent != new.agent or run.trigger.payload != payload:
        what = f"agent {run.agent!r}" if run.agent != new.agent else "another payload"
        log.warning(
            "idempotency key %r already names run %s, of %s: this dispatch returns it and"
            " stores nothing (give each agent's dispatch of a trigger its own key)",
            new.idempotency_key,
            run.id,
            what,
        )


def run_id(run_id: str) -> str:
    """``run_id``, or RunNotFoundError for what cannot be any run's id."""
    if not isinstance(run_id, str) or not is_storable_key(run_id):
        raise RunNotFoundError(str(run_id))
    return run_id


def limit(limit: int) -> int:
    """``limit``, or ValueError if it is not a whole number of runs a read may return."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be a whole number from 1 to {MAX_LIMIT}, not {limit!r}")
    return limit
