"""CeleryScheduler: an execution is an ``agentruns.execute`` task on any worker."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("agentruns")

# Eager executions run inside the call that scheduled them, and a finished run
# schedules its key's next: a line of runs ran each inside the one before, until
# Python's recursion limit (about 120 deep). Past this depth, they run one after
# another in the outermost eager execution's call instead.
_MOST_NESTED = 16
_eager = threading.local()


class CeleryScheduler:
    """Sends ``agentruns.execute(run_id)``; every message is only a nudge, the claim decides.

    ``app`` defaults to ``agentruns.celery.app``, imported on first use, so that
    building an engine does not import Celery until something is scheduled.
    """

    def __init__(self, app: Any = None, *, task_name: str = "agentruns.execute") -> None:
        self._app = app
        self._task_name = task_name

    @property
    def app(self) -> Any:
        if self._app is None:
            from agentruns.celery import app

            self._app = app
        return self._app

    def _sending_app(self) -> Any:
        """The app of the task this is called in, if any (a team's own app's worker,
        or its eager tests): its executions go where that app's workers look. Else
        this scheduler's."""
        task = _current_task()
        return task.app if task is not None else self.app

    def bind(self, execute: Callable[[str], object], slots: int) -> None:
        pass  # executions happen in workers, through the task

    def schedule(self, run_id: str) -> None:
        from agentruns.broker import send_together

        app = self._sending_app()
        if app.conf.task_always_eager or _inside_an_eager_task():
            self._execute_here(app, run_id)
            return
        try:
            send_together(
                app,
                lambda producer, task_id: app.send_task(
                    self._task_name, args=[run_id], task_id=task_id, producer=producer
                ),
            )
        except Exception:
            # The write that queued the run has committed; a lost nudge is what
            # recover() exists for, so the caller's call still succeeded.
            log.warning(
                "could not send %s for run %s; recover() will reschedule it",
                self._task_name,
                run_id,
                exc_info=True,
            )

    def _execute_here(self, app: Any, run_id: str) -> None:
        """With ``task_always_eager`` (a team's test settings), the execution runs now,
        in this process, as every other task does: sent by name, it would wait in the
        broker for a worker nobody started, and the run would stay queued. (Nested
        deeper than ``_MOST_NESTED``, it runs once the outermost one returns.)"""
        depth: int = getattr(_eager, "depth", 0)
        if depth >= _MOST_NESTED:
            _eager.later.append((self, app, run_id))
            return
        if depth == 0:
            _eager.later = []
        _eager.depth = depth + 1
        try:
            self._apply(app, run_id)
            while depth == 0 and _eager.later:
                scheduler, later_app, later_id = _eager.later.pop(0)
                scheduler._apply(later_app, later_id)
        finally:
            _eager.depth = depth

    def _apply(self, app: Any, run_id: str) -> None:
        import agentruns.tasks  # noqa: F401  (the task, registered on every app)

        try:
            # Its failure is the run's, not that of the call that scheduled it.
            result = app.tasks[self._task_name].apply(args=[run_id], throw=False)
        except Exception:
            log.warning("could not run %s for run %s", self._task_name, run_id, exc_info=True)
            return
        if result.failed():
            log.warning("%s for run %s failed: %r", self._task_name, run_id, result.result)

    def outstanding(self) -> int:
        return 0  # executions run elsewhere; this process has none in flight

    def waiting(self) -> int | None:
        """Messages in the queue that executions go to (one round trip to the broker)."""
        from amqp.exceptions import ChannelError

        app = self._sending_app()
        queue = app.amqp.router.route({}, self._task_name, (), {})["queue"]
        try:
            with app.connection_for_write() as conn:
                _, count, _ = conn.default_channel.queue_declare(queue=queue.name, passive=True)
        except ChannelError:
            return 0  # never declared: nothing was ever sent to it
        except Exception:
            log.debug("could not count the messages of queue %s", queue.name, exc_info=True)
            return None
        return int(count)

    def close(self) -> None:
        pass


def _inside_an_eager_task() -> bool:
    """Called from a task running eagerly: a team's own app with ``task_always_eager``
    that includes agentruns' tasks (this scheduler's app, agentruns', is not eager)."""
    task = _current_task()
    return task is not None and bool(task.request.is_eager)


def _current_task() -> Any:
    """The task this thread runs, or None: ``celery.current_task``'s object, from the
    module that holds it. (Through the ``celery`` package, whose names load as they
    are first asked for, threads sending their first executions at once raised
    ``ImportError: cannot import name 'current_task'`` after their runs were stored.)"""
    from celery._state import get_current_task

    return get_current_task()
