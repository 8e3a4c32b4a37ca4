"""ManualScheduler: only records what was scheduled; the caller runs ``engine.execute`` itself.

The in-process double of the scheduler protocol, for tests and benchmarks that
decide when and where executions happen (a helper process, a timed loop).
"""

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

    def waiting(self) -> int | None:
        return None  # the caller's to know

    def close(self) -> None:
        pass
