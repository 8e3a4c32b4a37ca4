"""Exceptions raised by agentruns."""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from pydantic import ValidationError

TokenProblem = Literal["malformed", "bad_signature", "expired", "stale"]


def exception_text(exc: BaseException, *, typed: bool = True) -> str:
    """What an exception says, after its type's name (``"ValueError: odd"``) unless not
    ``typed``. Code that is not agentruns' (a tool, a model, a notifier) may raise one
    whose ``str()`` raises or returns no text: that one is ``<unprintable ValueError>``."""
    name = type(exc).__name__
    try:
        said = str(exc)
    except Exception:
        return f"<unprintable {name}>"
    return f"{name}: {said}" if typed else said


def first_line(exc: BaseException, *, typed: bool = True) -> str:
    """An exception in one line, for a log or the CLI (an outage's: SQLAlchemy's go on
    for several): its first line that says something, after its type's name unless
    not ``typed``."""
    lines = [line.strip() for line in exception_text(exc, typed=typed).splitlines()]
    said = next((line for line in lines if line), "")
    return (said or type(exc).__name__)[:500]


def shortened(text: str, limit: int) -> str:
    """``text``, or its beginning and how many characters more there were, ``limit``
    characters in all (so shortening it again leaves it as it is)."""
    if len(text) <= limit:
        return text
    kept = limit - 40  # room for the count
    return f"{text[:kept]}… ({len(text) - kept} more characters)"


def one_line(text: str, limit: int) -> str:
    """``text`` in one line, each run of whitespace (line breaks too) one space,
    ``shortened`` to ``limit``: what a server said may be a whole HTML page."""
    return shortened(" ".join(text.split()), limit)


def problems(exc: ValidationError, whole: str) -> str:
    """pydantic's errors in one line: each field's message, ``whole`` naming the value
    itself (pydantic's own text runs over several lines, with a link each)."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or whole}: {e['msg'].removeprefix('Value error, ')}"
        for e in exc.errors()
    )


def stops_the_task(exc: BaseException) -> bool:
    """Whether ``exc`` stops the task it was raised in, rather than telling of a failure
    of the code it interrupted: a Celery worker's time limit (``SoftTimeLimitExceeded``,
    raised wherever the task is, just before the pool kills the process), or
    ``KeyboardInterrupt`` or ``SystemExit`` in the main thread (a signal: the process
    is stopping). In a pool's thread, no signal raises those two: the code did
    (argparse's exit on bad arguments); nor in a task of a Celery worker, but for
    its hard shutdown's. Never a tool's or a model's error: raised on,
    the run is left for ``recover``, as after a crash."""
    # (Looked up, not imported: only a Celery worker, which has it, raises it.)
    time_limit = getattr(sys.modules.get("billiard.exceptions"), "SoftTimeLimitExceeded", None)
    if time_limit is not None and isinstance(exc, time_limit):
        return True
    stopping = isinstance(exc, KeyboardInterrupt | SystemExit)
    if not stopping or threading.current_thread() is not threading.main_thread():
        return False
    if _in_a_celery_workers_task():
        # A Celery worker's signal handlers only set flags (its warm and cold
        # shutdowns): what raises in the main thread is its hard shutdown,
        # WorkerTerminate (WorkerShutdown is its kin), inside a solo pool's task, and
        # the SIGTERM a prefork pool's process gets (billiard's handler exits).
        # Anything else was raised by the code, as in a pool's thread.
        exceptions = sys.modules.get("celery.exceptions")
        names = ("WorkerTerminate", "WorkerShutdown")
        return _terminating() or any(
            isinstance(exc, getattr(exceptions, name, ())) for name in names
        )
    return True


def _terminating() -> bool:
    """Has billiard's handler of a terminating signal run in this process?"""
    common = sys.modules.get("billiard.common")
    fired = getattr(common, "terminate_handler_fired", None)
    if fired is not None:
        return bool(fired())
    return bool(getattr(common, "_should_have_exited", [False])[0])  # an older billiard


def _in_a_celery_workers_task() -> bool:
    """Is this thread inside a task a Celery worker received, even through an eager
    one that task applied (``.apply()``, an eager app's send)?"""
    state = sys.modules.get("celery._state")
    tasks = state._task_stack.stack if state is not None else []
    return any(not (t.request.called_directly or t.request.is_eager) for t in tasks)


def rebuilt(
    cls: type[BaseException], args: tuple[object, ...], state: dict[str, object]
) -> BaseException:
    """An exception unpickled as it was, its ``__init__`` not called again (see
    ``AgentrunsError.__reduce__``)."""
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class AgentrunsError(Exception):
    """Base class of every error agentruns raises on purpose."""

    def __reduce__(self) -> tuple[object, ...]:
        # Pickled whole: a prefork worker's process sends a task's error to its main
        # process so, and Celery keeps one so. By default, unpickling calls the class
        # with the finished message (UnknownAgentError said "unknown agent "unknown
        # agent 'x'"") and a NotifierError, which takes two arguments, not at all.
        return rebuilt, (type(self), self.args, dict(self.__dict__))


class LeaseLostError(AgentrunsError):
    """Another engine owns the run: the writer must stop and write nothing more."""

    def __init__(self, run_id: str, message: str | None = None) -> None:
        self.run_id = run_id
        super().__init__(message or f"lost the claim on run {run_id}")


class FatalToolError(AgentrunsError):
    """Raised by a tool to fail the whole run (error code ``fatal_tool_error``)."""


class InvalidTokenError(AgentrunsError):
    """A resume token was refused; ``reason`` says why. Nothing was changed."""

    def __init__(self, reason: TokenProblem, message: str | None = None) -> None:
        self.reason: TokenProblem = reason
        self.detail = message  # what the reason stands for here, if said
        # The reason is always said: a worker's log is searched for it.
        said = f"invalid resume token ({reason}): {message}" if message else None
        super().__init__(said or f"invalid resume token: {reason}")


class UnknownAgentError(AgentrunsError):
    """No agent of that name is registered with the engine."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"unknown agent {name!r}")


class RunNotFoundError(AgentrunsError):
    """No run has that id."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__(f"run {run_id!r} not found")


class NotRetryableError(AgentrunsError):
    """``retry`` refused: the run is not failed, or a later run of its thread has started
    (it went on without this one). Nothing was changed."""

    def __init__(self, run_id: str, message: str) -> None:
        self.run_id = run_id
        super().__init__(message)


class InvalidTriggerError(AgentrunsError):
    """The trigger is not a valid envelope, or its payload is not JSON."""


class InvalidAnswerError(AgentrunsError, TypeError):
    """An answer to an approval whose ``approved`` is not a bool or whose ``reason``
    is not text (a ``TypeError`` too; an ``AgentrunsError`` for a task to say in one
    line, as it does a bad token)."""


class InvalidSettingError(AgentrunsError, ValueError):
    """An ``AGENTRUNS_*`` variable holds what its setting cannot take (it is named)."""


class NotMigratedError(AgentrunsError):
    """The database schema is missing or behind: run ``agentruns migrate``."""


class InvalidCheckpointError(AgentrunsError):
    """The stored transcript cannot be continued (error code ``invalid_checkpoint``)."""


class NotifierError(AgentrunsError):
    """An agent's notifier raised (what it raised is the ``__cause__``). Reported to
    ``on_error``; nothing else fails with it, and ``tick`` calls the notifier again."""

    def __init__(self, run_id: str, exc: BaseException) -> None:
        self.run_id = run_id
        super().__init__(f"the notifier of run {run_id} failed: {exception_text(exc)}")
