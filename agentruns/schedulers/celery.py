"""CeleryScheduler: an execution is an ``agentruns.execute`` task on any worker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class CeleryScheduler:
    """Sends ``agentruns.execute(run_id)``; every message is only a nudge, the claim decides."""

    def __init__(self, app: Any = None, *, task_name: str = "agentruns.execute") -> None:
        self._app = app
        self._task_name = task_name

    @property
    def app(self) -> Any:
        if self._app is None:
            from agentruns.celery import app

            self._app = app
        return self._app

    def bind(self, execute: Callable[[str], object], slots: int) -> None:
        pass  # executions happen in workers, through the task

    def schedule(self, run_id: str) -> None:
        self.app.send_task(self._task_name, args=[run_id])

    def outstanding(self) -> int:
        return 0

    def close(self) -> None:
        pass
