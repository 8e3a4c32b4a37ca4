"""A scheduler that only records: the test decides when and where executions happen."""

from __future__ import annotations

from collections.abc import Callable


class ManualScheduler:
    def __init__(self) -> None:
        self.scheduled: list[str] = []

    def bind(self, execute: Callable[[str], object], slots: int) -> None:
        pass

    def schedule(self, run_id: str) -> None:
        self.scheduled.append(run_id)

    def outstanding(self) -> int:
        return 0

    def close(self) -> None:
        pass
