"""The lease protocol: who may execute a run right now."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable


@runtime_checkable
class Leases(Protocol):
    """A time-limited, owner-checked lock per run, plus a channel to abort its holder.

    ``acquire`` succeeds only if nobody holds the run's lease; ``renew`` and
    ``release`` act only if ``owner`` still holds it. ``request_abort`` tells
    whichever process holds the run (anywhere) to abort it soon;
    ``on_abort_request`` registers this process's handler and returns a
    function that unregisters it.

    ``give_up`` notes that a live owner let a claim of the run go (an outage, a lost
    lease, a shutdown), for ``given_up`` to tell ``recover`` that the claim did not
    end with its process: the run is not held back for it.

    Leases that are only this process's (``LocalLeases``) set ``process_local``:
    an abort another process asks for cannot reach their handlers, so an engine
    looks for its runs' cancels in the store instead (every ``CANCEL_LOOK_S``).
    """

    def acquire(self, run_id: str, owner: str, ttl_s: float) -> bool: ...

    def renew(self, run_id: str, owner: str, ttl_s: float) -> bool: ...

    def release(self, run_id: str, owner: str) -> bool: ...

    def holder(self, run_id: str) -> str | None: ...

    def give_up(self, run_id: str, epoch: int, ttl_s: float) -> None: ...

    def given_up(self, run_id: str, epoch: int) -> bool: ...

    def request_abort(self, run_id: str) -> None: ...

    def on_abort_request(self, handler: Callable[[str], None]) -> Callable[[], None]: ...

    def close(self) -> None: ...
