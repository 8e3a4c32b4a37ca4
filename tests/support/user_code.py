"""User code as the README writes it, for mypy --strict. A line ending in
``# error: CODE`` must get that error code there, and no other line an error."""

from __future__ import annotations

from agentruns import Engine, SqlStore
from agentruns.events import Event
from agentruns.tasks import dispatch, resume

engine = Engine(SqlStore("sqlite:///never.db"), secret="s")

# Listeners: each event type's listener gets what that event carries.
engine.on("step.appended", lambda event: print(event.step.index, event.step.kind))
engine.on("run.updated", lambda event: print(event.run.status, event.run.id))


def any_event(event: Event) -> None:
    print(event.type, event.run, event.step)


engine.on("run.updated", any_event)
engine.on("step.appended", any_event)


# Tasks: sent with the function's own arguments, the message's id a str.
def handle(ticket_id: str) -> str:
    sent = dispatch.delay("triage", {"source": "t", "trigger": "t", "id": ticket_id})
    return sent.id


dispatch.delay("triage", 42)  # error: arg-type
resume.delay("token", approved="yes")  # error: arg-type
dispatch.apply_async(args=("triage", {}), countdown=5)
dispatch.s("triage", {})  # Celery's other attributes: untyped, not refused

# Settings overrides: a misspelt one is an error.
Engine.from_settings(slots=3, secret="s")
Engine.from_settings(slot=3)  # error: call-arg

# The package's names are loaded when first asked for; a misspelt one is still an error.
from agentruns import Engnie  # noqa: E402, F401  # error: attr-defined
from agentruns.models import ScriptedModle  # noqa: E402, F401  # error: attr-defined
