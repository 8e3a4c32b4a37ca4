"""``retry()``: a failed run queued again to go on from its latest checkpoint, once
per request (the ``agentruns.retry`` task's message id), and told why when it cannot
be (it is not failed, or a later run of its thread has started)."""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol

from agentruns import intake
from agentruns.agent import Agent
from agentruns.errors import NotRetryableError
from agentruns.events import Events
from agentruns.runs import Budget, Run, RunStatus
from agentruns.schedulers.base import Scheduler
from agentruns.store.base import Store

log = logging.getLogger("agentruns")


class Host(Protocol):
    """What a retry needs from the engine whose run it queues."""

    store: Store
    scheduler: Scheduler
    events: Events

    @property
    def agents(self) -> dict[str, Agent]: ...


class Retries:
    def __init__(self, host: Host) -> None:
        self.host = host

    def retry(
        self, run_id: str, budget: Budget | dict[str, Any] | None, request_id: str | None
    ) -> Run:
        """``Engine.retry`` of a checked run id and request id."""
        before = self.host.store.get_run(run_id)  # its failure, said once it is cleared
        raised = None
        if budget is not None:
            raised = intake.retried_budget(self.host.agents, before, budget)
        with self.host.events.writing(run_id):
            run, retried = self.host.store.retry(run_id, raised, request_id)
            if retried:
                self.host.events.run_updated(run)
        if not retried and request_id is not None and self._answered_already(run, request_id):
            return run
        if not retried and run.status is not RunStatus.QUEUED:
            raise NotRetryableError(run_id, self._why_not_retried(run))
        if not retried and raised is not None and run.budget != raised:
            # Another retry queued it first, with its own budget: this one's would
            # not be applied, and its caller be told it was.
            raise NotRetryableError(
                run_id,
                f"run {run_id} is queued already (retried by another caller?) with"
                f" budget {_limits(run.budget)}, not this retry's {_limits(raised)}",
            )
        if retried:
            failure = before.error
            log.info(
                "run %s queued again after it failed%s",
                run_id,
                f" ({failure.code}: {failure.message[:300]})" if failure is not None else "",
            )
        self.host.scheduler.schedule(run_id)
        return run

    def _answered_already(self, run: Run, request_id: str) -> bool:
        """Note the retry request ``request_id`` as answered (the run nudged, or the retry
        refused); if it was already, say so, and nudge the run if it is queued."""
        if self.host.store.note_retry(run.id, request_id):
            return False
        shown = request_id[:200]
        # A warning where the run stays failed: a caller that gives each retry task
        # one fixed id (a habit for deduplicating tasks) has its later retries ignored.
        log.log(
            logging.WARNING if run.status is RunStatus.FAILED else logging.INFO,
            "run %s: retry %s was answered already (the run is %s now): not again",
            run.id,
            shown if shown.isprintable() else repr(shown),
            run.status.value,
        )
        if run.status is RunStatus.QUEUED:
            self.host.scheduler.schedule(run.id)
        return True

    def _why_not_retried(self, run: Run) -> str:
        if run.status is not RunStatus.FAILED:
            return f"run {run.id} is {run.status.value}: only a failed (or queued) run is retried"
        later = self.host.store.thread_went_on(run.id)
        if later is None:  # it changed meanwhile
            return f"run {run.id} could not be retried as it was; look at it again"
        return (
            f"run {run.id} cannot be retried: run {later} of its thread {run.thread!r} has"
            " started since, from the thread's runs before it; dispatch to the thread again"
        )


def _limits(budget: Budget | None) -> str:
    if budget is None:
        return "its agent's"
    return json.dumps(budget.model_dump(mode="json"))
