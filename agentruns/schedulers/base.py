"""The scheduler protocol: how an execution of a run gets started somewhere."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable


@runtime_checkable
class Scheduler(Protocol):
    """Asks for ``execute(run_id)`` to happen soon, somewhere; at least once, maybe more.

    A schedule is only a nudge: the claim decides who runs, so duplicates are
    harmless and a lost one is found by ``recover()``.
    """

    def bind(self, execute: Callable[[str], object], slots: int) -> None: ...

    def schedule(self, run_id: str) -> None: ...

    def outstanding(self) -> int: ...

    def waiting(self) -> int | None:
        """Nudges sent and not yet taken up by what executes them; None: unknown."""
        ...

    def close(self) -> None: ...
