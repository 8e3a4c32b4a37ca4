"""The Celery tasks: thin doors onto the worker's engine (SPEC §6).

Every message is an at-least-once nudge. ``execute`` on a run this worker
cannot claim does nothing; a redelivered ``dispatch`` finds the run it
already stored. Bad input (an unknown agent or run, a bad trigger or token)
fails the task once, with the error as its result and no traceback; only a
database or Redis outage is retried, a few times, since ``recover`` and the
producer own anything beyond that.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from celery.exceptions import Reject

from agentruns.celery import app, get_engine, shutting_down
from agentruns.errors import AgentrunsError
from agentruns.runs import Run, RunStatus

log = logging.getLogger("agentruns")

F = TypeVar("F", bound=Callable[..., Any])

# Expected errors: reported as the task's failure, logged without a traceback, never retried.
_EXPECTED = (AgentrunsError,)
_MAX_RETRIES = 5
_RETRY_BACKOFF_MAX_S = 60


def _task(name: str) -> Callable[[F], Any]:
    """``app.task`` with the options every agentruns task shares (typed for mypy)."""
    decorator: Callable[[F], Any] = app.task(
        name=name, bind=True, throws=_EXPECTED, max_retries=_MAX_RETRIES
    )
    return decorator


@contextlib.contextmanager
def _retrying_outages(task: Any) -> Iterator[None]:
    """Retry the task after a database or Redis outage; let anything else through."""
    try:
        yield
    except _EXPECTED:
        raise
    except Exception as exc:
        if get_engine().is_infrastructure_error(exc):
            delay = min(_RETRY_BACKOFF_MAX_S, 2**task.request.retries)
            raise task.retry(exc=exc, countdown=delay) from exc
        raise


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
    if idempotency_key is None and not (isinstance(trigger, dict) and trigger.get("id")):
        idempotency_key = f"task:{self.request.id}"
    engine = get_engine()
    with _retrying_outages(self):
        kwargs: dict[str, Any] = {
            "idempotency_key": idempotency_key,
            "concurrency_key": concurrency_key,
            "thread": thread,
            "budget": budget,
        }
        if shutting_down():
            run = engine.dispatch(agent, trigger, **kwargs, schedule=False)
        else:
            run = engine.dispatch_here(agent, trigger, **kwargs)
        if run.status is RunStatus.QUEUED:
            engine.scheduler.schedule(run.id)
    return run.id


@_task("agentruns.execute")
def execute(self: Any, run_id: str) -> dict[str, Any]:
    """One execution of the run, if this worker can claim it; otherwise nothing."""
    if shutting_down():
        # Give the message back for a worker that stays, instead of acking a no-op.
        raise Reject("the worker is shutting down", requeue=True)
    run = get_engine().execute(run_id)
    if run.status is RunStatus.QUEUED and shutting_down():
        raise Reject("the worker is shutting down", requeue=True)
    return _summary(run)


@_task("agentruns.resume")
def resume(self: Any, token: str, approved: bool, reason: str | None = None) -> dict[str, Any]:
    """Answer the approval a resume token stands for; the run is queued again."""
    with _retrying_outages(self):
        run = get_engine().resume(token, approved=approved, reason=reason)
    return _summary(run)


@_task("agentruns.cancel")
def cancel(self: Any, run_id: str) -> dict[str, Any]:
    """Cancel the run (a running one is aborted by whichever worker owns it)."""
    with _retrying_outages(self):
        run = get_engine().cancel(run_id)
    return _summary(run)


@_task("agentruns.tick")
def tick(self: Any) -> None:
    """Expire approvals past their time; re-send notifications that did not go through."""
    get_engine().tick()


@_task("agentruns.recover")
def recover(self: Any) -> list[str]:
    """Requeue interrupted, orphaned and long-queued runs; returns their ids."""
    requeued = get_engine().recover()
    if requeued:
        log.info("recover requeued %d run(s): %s", len(requeued), ", ".join(requeued))
    return requeued
