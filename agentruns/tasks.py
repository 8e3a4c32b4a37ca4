"""The Celery tasks: thin doors onto the worker's engine (SPEC §6).

Every message is an at-least-once nudge. ``execute`` on a run this worker
cannot claim does nothing; a redelivered ``dispatch`` finds the run it
already stored. Bad input (an unknown agent or run, a bad trigger or token)
fails the task once, with the error as its result and no traceback.

A database or Redis outage is retried with backoff for as long as it lasts: a
``dispatch``, ``resume``, ``cancel`` or ``retry`` message is the only record of
what its producer asked, and acking it unanswered would lose that. (``execute``,
``tick`` and ``recover`` need no retry: the runs are stored, and beat's
``recover`` schedules them again.) A worker that cannot build its engine (a
database not migrated yet, wrong settings or agent modules) gives every message
back to the queue, for a worker that can.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from celery import Task
from celery.exceptions import ImproperlyConfigured, Reject
from celery.utils.saferepr import saferepr
from celery.worker.request import Request

from agentruns import approvals, intake
from agentruns.broker import send_together
from agentruns.celery import AMQP, app
from agentruns.engine import Engine
from agentruns.errors import AgentrunsError, NotMigratedError, UnknownAgentError, first_line
from agentruns.outages import OUTAGE
from agentruns.runs import Run, RunStatus
from agentruns.worker import (  # and a worker's signal handlers
    get_engine,
    say_once_why_there_is_no_engine,
    shutting_down,
)

log = logging.getLogger("agentruns")

P = ParamSpec("P")
R = TypeVar("R", covariant=True)

# Expected errors: reported as the task's failure, logged without a traceback, never retried.
_EXPECTED: tuple[type[Exception], ...] = (AgentrunsError,)
_RETRY_BACKOFF_MAX_S = 60
_GIVE_BACK_PAUSE_S = 1.0
_NO_SOFT_LIMIT_S = 10.0**9  # no hard limit either: a soft limit that never comes
_SOFT_LIMIT_LEAD_S = 10.0  # at most, before the hard limit (a quarter of it at most)


class _Task(Task):  # type: ignore[misc]
    """An agentruns task: what it shows of its arguments is said here, not left to
    Celery's ``repr`` of them.

    Celery puts a ``repr`` of every task's arguments in the message's headers and
    in the ``task-sent`` and ``task-received`` events, which Flower shows to anyone
    who can open it. A trigger's payload is whatever the sender had (an email, a
    customer's ticket), and a resume token is a credential: neither goes there.
    The message itself still carries them, for the worker. (Celery's ``repr`` of
    a large payload also cost a producer about a fifth of its CPU per send.)
    """

    # What a worker lists of a task it holds (Flower's worker page, `celery inspect`).
    Request = "agentruns.tasks:_Request"

    @property
    def soft_time_limit(self) -> float:
        """No soft limit of the worker's (``--soft-time-limit``, ``task_soft_time_limit``,
        ``task_annotations``) reaches these tasks: it would stop every execution longer
        than it, again after each recovery (a model call that takes longer would never
        complete). ``Budget.timeout_s`` bounds a run instead, and settles it cleanly.

        Only the hard limit stays (a backstop for a hung prefork child). The prefork
        pool starts its hard timer when the soft one fires, ``hard - soft`` after it,
        so the soft limit is set a little before the hard one: the execution, stopped
        by ``SoftTimeLimitExceeded``, settles its run ``interrupted`` for ``recover``
        before the pool kills the process. Without a hard limit, none at all."""
        hard: float | None = self.time_limit
        if not hard:
            return _NO_SOFT_LIMIT_S
        return hard - min(_SOFT_LIMIT_LEAD_S, hard / 4)

    def _get_exec_options(self) -> dict[str, Any]:
        """Celery's, without the time limits. Celery writes a task's limits into each
        message, and a worker takes a message's over its own: the limits would be the
        sender's (a producer's settings, or none at all in a team's own app, whose
        soft limit of 10^9 s would also keep the pool's hard timer from ever
        starting). Left out, the worker's settings decide, through the properties."""
        options: dict[str, Any] = dict(super()._get_exec_options())
        options["time_limit"] = options["soft_time_limit"] = None
        return options

    @classmethod
    def annotate(cls) -> None:
        """Celery's annotations, but a ``soft_time_limit`` (``{"*": {...}}`` reaches
        these tasks too): Celery sets it on the class, over the property above."""
        super().annotate()
        if "soft_time_limit" in vars(cls):
            log.warning(
                "%s: agentruns' tasks ignore the soft time limit of task_annotations", cls.name
            )
            delattr(cls, "soft_time_limit")

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        *rest: Any,
        **options: Any,
    ) -> Any:
        """Celery's ``apply_async``; the message and its ``task-sent`` event are sent
        together, in one round trip (``agentruns.broker.send_together``)."""
        _refuse_protocol_1(self)
        _check_arguments(self, args, kwargs)
        if "argsrepr" not in options and "kwargsrepr" not in options:
            options["argsrepr"], options["kwargsrepr"] = _arguments_shown(self, args, kwargs)
        if options.get("connection") is not None:  # Celery makes a producer of its own
            return Task.apply_async(self, args, kwargs, task_id, producer, *rest, **options)

        def send(pooled: Any, sent_id: str) -> Any:
            return Task.apply_async(self, args, kwargs, sent_id, pooled, *rest, **options)

        return send_together(self.app, send, producer, task_id)


def _check_arguments(task: Any, args: Any, kwargs: Any) -> None:
    """What the worker would refuse of a task's arguments whatever the database holds,
    refused where it is sent: else it is refused in the worker's log, and the sender
    never knows (a NaN in a dispatch's payload, an empty trigger id, a budget of 0
    steps, ``approved="yes"``). ``InvalidTriggerError`` or ``InvalidAnswerError``."""
    if task.name not in ("agentruns.dispatch", "agentruns.resume", "agentruns.retry"):
        return
    given = dict(zip(_parameters(task.run), args or (), strict=False)) | dict(kwargs or {})
    if task.name == "agentruns.dispatch" and "trigger" in given:
        names = ("trigger", "idempotency_key", "concurrency_key", "thread", "budget")
        intake.check_dispatch(**{name: given[name] for name in names if name in given})
    elif task.name == "agentruns.resume" and "approved" in given:
        approvals.check_answer(given["approved"], given.get("reason"))
    elif task.name == "agentruns.retry":
        intake.check_budget(given.get("budget"))


def _refuse_protocol_1(task: Any) -> None:
    """A team's own Celery app set to ``task_protocol = 1`` would send these tasks in
    messages without ``argsrepr``: their ``task-sent`` events would show a trigger's
    payload and a resume token. agentruns' app sends its tasks with protocol 2
    whatever the setting (``agentruns.celery.AMQP``); another app must too. Refused
    where it is sent; but not where such an app's worker retries the message it
    holds through an outage (refused there, the message would be dropped)."""
    app = task.app
    conf = app.conf
    if conf.task_protocol == 2 or conf.task_always_eager or isinstance(app.amqp, AMQP):
        return
    if not task.request.called_directly:  # a worker's retry of the task it runs
        log.warning(
            "%s: retried with task_protocol = 1, whose task events show its arguments;"
            " set task_protocol = 2",
            task.name,
        )
        return
    raise ImproperlyConfigured(
        f"agentruns' tasks are sent with Celery's message protocol 2, and the app "
        f"{app.main!r} has task_protocol = {conf.task_protocol!r}, whose task events "
        "would show a trigger's payload and a resume token: set task_protocol = 2, or "
        "make the app with Celery(..., amqp='agentruns.celery:AMQP'), which keeps the "
        "setting for its other tasks"
    )


class _Request(Request):  # type: ignore[misc]
    """A task a worker holds, listed as its events show it: ``inspect scheduled``,
    ``reserved`` and ``revoked`` (and Flower's worker page, which calls them) ask
    for Celery's raw arguments; only ``active`` asks for the shown ones."""

    def info(self, safe: bool = False) -> dict[str, Any]:
        info: dict[str, Any] = super().info(safe=True)
        return info


def _arguments_shown(task: Any, args: Any, kwargs: Any) -> tuple[str, str]:
    """The ``argsrepr`` and ``kwargsrepr`` of a call of ``task``: its arguments, but a
    trigger without its payload and a resume token not at all."""
    names = _parameters(task.run)
    positional = list(args or ())
    named = dict(kwargs or {})
    shown_args = [_shown(name, value) for name, value in zip(names, positional, strict=False)]
    shown_args += positional[len(names) :]  # more than the task takes: shown as they are
    shown_kwargs = {key: _shown(key, value) for key, value in named.items()}
    amqp = task.app.amqp
    return (
        _repr(tuple(shown_args), amqp.argsrepr_maxsize),
        _repr(shown_kwargs, amqp.kwargsrepr_maxsize),
    )


def _repr(value: Any, most: int) -> str:
    """``repr``, cut at Celery's bound (``app.amqp.argsrepr_maxsize`` and its kwargs
    twin). The arguments are JSON's types and small once the payload is hidden, and
    ``repr`` is about ten times cheaper per send than Celery's ``saferepr`` (which
    guards against what they cannot hold)."""
    try:
        text = repr(value)
    except Exception:
        return str(saferepr(value, most))
    return text if len(text) <= most else text[: most - 3] + "..."


@functools.cache
def _parameters(run: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(run).parameters)


class _Hidden:
    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _shown(name: str, value: Any) -> Any:
    if name == "token":
        return _Hidden("<resume token>")
    if name == "trigger":
        if isinstance(value, dict):
            return {k: (_Hidden("<payload>") if k == "payload" else v) for k, v in value.items()}
        return _Hidden(f"<{type(value).__name__}>")
    return value


class Sent(Protocol):
    """What sending a task returns (Celery's ``AsyncResult``), as far as agentruns
    types it: the message's id."""

    @property
    def id(self) -> str: ...


class AgentrunsTask(Protocol[P, R]):
    """One of agentruns' Celery tasks as a type checker sees it: called in this
    process, or sent with ``delay`` (the arguments checked as the function's) or
    ``apply_async``. Celery's other task attributes are there too, untyped."""

    name: str

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R: ...
    def delay(self, *args: P.args, **kwargs: P.kwargs) -> Sent: ...
    def apply_async(
        self,
        args: tuple[Any, ...] | list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> Sent: ...
    def __getattr__(self, name: str) -> Any: ...


def _task(
    name: str, throws: tuple[type[Exception], ...] = _EXPECTED
) -> Callable[[Callable[Concatenate[Any, P], R]], AgentrunsTask[P, R]]:
    """``app.task`` with the options every agentruns task shares (typed for mypy: the
    task without its bound ``self``).

    The delivery options are the task's own, not read from the app's settings: a
    team's own Celery app that includes ``agentruns.tasks`` keeps Celery's defaults
    (acks early, a result per task), and a message its worker lost mid-task would be
    a lost run (``defaults`` says why each is what it is)."""
    decorator: Callable[[Callable[Concatenate[Any, P], R]], AgentrunsTask[P, R]] = app.task(
        name=name,
        base=_Task,
        bind=True,
        throws=throws,
        max_retries=None,
        acks_late=True,
        reject_on_worker_lost=True,
        ignore_result=True,
    )
    return decorator


@contextlib.contextmanager
def _retrying_outages(task: Any) -> Iterator[None]:
    """Retry the task while the database or Redis is away or the database is not
    migrated (also when the worker's engine cannot be built for that); let anything
    else through, and everything when the task runs eagerly, in its caller."""
    try:
        yield
    except Exception as exc:
        if task.request.is_eager:
            # Celery retries an eager task at once, inside itself, with no countdown:
            # through an outage, that ends in a RecursionError. The caller gets the error.
            raise
        if isinstance(exc, NotMigratedError) or Engine.is_infrastructure_error(exc):
            delay = min(_RETRY_BACKOFF_MAX_S, 2**task.request.retries)
            raise task.retry(exc=exc, countdown=delay) from exc
        raise


def _engine_or_give_back(task: Any) -> Engine:
    """This worker's engine. One that cannot be built gives the message back, after a
    pause (so a worker alone does not spin on it), for a worker that can take it:
    acked here, a nudge or a sweep meant for the others was lost, and a dispatch,
    resume, cancel or retry was the only record of what its producer asked. That is
    a worker deployed before ``agentruns migrate``, or one whose settings or agent
    modules are wrong (a module that fails to import, an agent named twice, no
    ``AGENTRUNS_SECRET``): beside a good worker, it took and failed nine in ten
    dispatches. (One that cannot be built because the database or Redis is away
    raises that outage, as a built one's calls do; run eagerly or called, in its
    caller, the error is the caller's.)"""
    try:
        return get_engine(task.app)
    except Exception as exc:
        if task.request.is_eager or task.request.called_directly:
            raise  # the caller's, not a worker's: nothing to give back
        if Engine.is_infrastructure_error(exc):
            raise
        if isinstance(exc, NotMigratedError):
            why = f"this worker cannot work on this database yet: {exc}"
        else:
            say_once_why_there_is_no_engine(exc)
            why = f"this worker cannot build its engine ({first_line(exc)}); mend and restart it"
        time.sleep(_GIVE_BACK_PAUSE_S)
        # (Not chained: Celery logs a rejection with its traceback, and the whole chain
        # of a refused schema or a failed import, every second, for every message.)
        raise Reject(why, requeue=True) from None


class _RejectionInOneLine(logging.Filter):
    """Celery logs every rejected message with a traceback, which for an agentruns
    task says nothing its one line does not (a message given back, why): a worker
    that cannot build its engine gave back messages every second, at 14 lines each."""

    def filter(self, record: logging.LogRecord) -> bool:
        data = getattr(record, "data", None)
        if (
            isinstance(data, dict)
            and data.get("description") == "rejected"
            and str(data.get("name", "")).startswith("agentruns.")
        ):
            record.exc_info = None
            record.exc_text = None
        return True


logging.getLogger("celery.app.trace").addFilter(_RejectionInOneLine())


def _summary(run: Run) -> dict[str, Any]:
    # What Flower shows as the task's result.
    return {"run_id": run.id, "agent": run.agent, "status": run.status.value}


@_task("agentruns.dispatch")
def dispatch(
    self: Any,
    agent: str,
    trigger: dict[str, Any],
    idempotency_key: str | None = None,
    concurrency_key: str | None = None,
    thread: str | None = None,
    budget: dict[str, Any] | None = None,
) -> str:
    """Store the run and execute it here; returns the run id.

    The worker that stores the run runs it right away: one message per run
    instead of a dispatch and an execute, and a run no concurrency key holds
    back is stored already claimed. The claim still decides; a run this worker
    cannot take now (a busy concurrency key, a shutdown) gets an ``execute``
    nudge instead. Without an idempotency key or a trigger id, the
    message's own id is the key, so a redelivered or retried message does not
    store a second run.
    """
    # (An empty id is no id: refused as the trigger's, not replaced by the message's.)
    if idempotency_key is None and not (
        isinstance(trigger, dict) and trigger.get("id") is not None
    ):
        idempotency_key = f"task:{self.request.id}"
    with _retrying_outages(self):
        engine = _engine_or_give_back(self)
        kwargs: dict[str, Any] = {
            "idempotency_key": idempotency_key,
            "concurrency_key": concurrency_key,
            "thread": thread,
            "budget": budget,
        }
        try:
            if shutting_down():
                run = engine.dispatch(agent, trigger, **kwargs, schedule=False)
            else:
                # The notifier of a run that pauses holds none of the pool's threads.
                run = engine.dispatch_here(agent, trigger, **kwargs, wait_for_notifiers=False)
        except UnknownAgentError as exc:
            # No run is stored, so nothing but this line tells of it (Celery's says it
            # at INFO): a producer's agent this worker lacks, or a misspelt name.
            log.warning(
                "agentruns dispatch %s: %s (this worker has %s: AGENTRUNS_AGENTS); nothing"
                " was stored",
                self.request.id,
                exc,
                ", ".join(map(repr, engine.agents)) or "none",
            )
            raise
        if run.status is RunStatus.QUEUED:
            engine.scheduler.schedule(run.id)
    return run.id


@contextlib.contextmanager
def _outage_in_one_line(said: str) -> Iterator[None]:
    """A task that needs no retry (its run is stored: recover schedules it again; a
    sweep: beat sends the next soon) fails through an outage in one warning line:
    its traceback, each time, flooded a worker's log while the database was away.
    (Those tasks' ``throws`` keep Celery's own line short.)"""
    try:
        yield
    except Exception as exc:
        if Engine.is_infrastructure_error(exc):
            log.warning("agentruns %s: %s", said, first_line(exc))
        raise


# Expected too, for the tasks above: an outage.
_OUTAGE_THROWS = (*_EXPECTED, *OUTAGE)


@_task("agentruns.execute", throws=_OUTAGE_THROWS)
def execute(self: Any, run_id: str) -> dict[str, Any]:
    """One execution of the run, if this worker can claim it; otherwise nothing."""
    if shutting_down():
        # Give the message back for a worker that stays, instead of acking a no-op.
        raise Reject("the worker is shutting down", requeue=True)
    with _outage_in_one_line(f"execute of run {run_id} could not run (recover runs it)"):
        run = _engine_or_give_back(self).execute(run_id, wait_for_notifiers=False)
    if run.status is RunStatus.QUEUED and shutting_down():
        raise Reject("the worker is shutting down", requeue=True)
    return _summary(run)


@_task("agentruns.resume")
def resume(self: Any, token: str, approved: bool, reason: str | None = None) -> dict[str, Any]:
    """Answer the approval a resume token stands for; the run is queued again."""
    with _retrying_outages(self):
        run = _engine_or_give_back(self).resume(token, approved=approved, reason=reason)
    return _summary(run)


@_task("agentruns.cancel")
def cancel(self: Any, run_id: str) -> dict[str, Any]:
    """Cancel the run (a running one is aborted by whichever worker owns it)."""
    with _retrying_outages(self):
        run = _engine_or_give_back(self).cancel(run_id)
    return _summary(run)


@_task("agentruns.retry")
def retry(self: Any, run_id: str, budget: dict[str, Any] | None = None) -> dict[str, Any]:
    """Queue a failed run again, to go on from its latest checkpoint, ``budget``'s limits
    replacing its own (``Engine.retry``). Once: the message delivered again (its worker
    died before it acked, or it retried an outage after a first try that went
    through) does not queue again a run that failed once more since."""
    with _retrying_outages(self):
        run = _engine_or_give_back(self).retry(run_id, budget=budget, request_id=self.request.id)
    return _summary(run)


@_task("agentruns.tick", throws=_OUTAGE_THROWS)
def tick(self: Any) -> None:
    """Expire approvals past their time; re-send notifications that did not go through."""
    with _outage_in_one_line("tick could not sweep"):
        # A webhook that hangs holds no pool thread, and ticks do not pile up on it.
        _engine_or_give_back(self).tick(wait_for_notifiers=False)


@_task("agentruns.recover", throws=_OUTAGE_THROWS)
def recover(self: Any) -> list[str]:
    """Requeue interrupted, orphaned and long-queued runs; returns their ids."""
    with _outage_in_one_line("recover could not sweep"):
        requeued = _engine_or_give_back(self).recover()
    if requeued:
        log.info("recover requeued %d run(s)", len(requeued))  # each said why
    return requeued
