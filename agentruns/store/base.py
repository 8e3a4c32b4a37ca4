"""The store protocol: what the engine asks of the database, in runs, steps and checkpoints."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from agentruns.runs import (
    Budget,
    Checkpoint,
    Run,
    RunError,
    RunStatus,
    Step,
    StepKind,
    TriggerEnvelope,
    Usage,
    WaitPoint,
)
from agentruns.store.schema import STEP_NAME_LENGTH


@dataclass(frozen=True)
class NewRun:
    id: str
    agent: str
    trigger: TriggerEnvelope
    idempotency_key: str | None
    concurrency_key: str | None
    thread: str | None
    budget: Budget | None

    def columns(self, now: datetime, claim: tuple[str, datetime] | None = None) -> dict[str, Any]:
        """The run's row as stored: queued, or running under ``claim`` (owner, expiry)
        at epoch 1, for the worker that executes it at once."""
        return {
            "id": self.id,
            "agent": self.agent,
            "status": (RunStatus.QUEUED if claim is None else RunStatus.RUNNING).value,
            "trigger": self.trigger.model_dump(mode="json"),
            "idempotency_key": self.idempotency_key,
            "concurrency_key": self.concurrency_key,
            "thread": self.thread,
            "budget": self.budget.model_dump(mode="json") if self.budget else None,
            "epoch": 0 if claim is None else 1,
            "claim_owner": None if claim is None else claim[0],
            "claim_expires_at": None if claim is None else claim[1],
            "created_at": now,
            "updated_at": now,
            "started_at": None if claim is None else now,
        }


@dataclass(frozen=True)
class NewStep:
    """A step to append; the store gives it the run's next index."""

    kind: StepKind
    name: str | None
    started_at: datetime
    finished_at: datetime
    input: Any = None
    output: Any = None
    error: Any = None

    def __post_init__(self) -> None:
        # A name the model made up (an unknown tool's) may be longer than the column.
        if self.name is not None and len(self.name) > STEP_NAME_LENGTH:
            object.__setattr__(self, "name", self.name[:STEP_NAME_LENGTH])


@dataclass(frozen=True)
class Guard:
    """The state a write expects the run to be in; a write whose guard fails changes nothing.

    ``epoch`` fences a running run to the execution that claimed it;
    ``token_id`` binds a waiting run to one wait point.
    """

    status: RunStatus
    epoch: int | None = None
    token_id: str | None = None


_UNSET: Any = object()


@dataclass
class Commit:
    """One atomic write: appended steps and messages, counters, a checkpoint, a settle."""

    steps: list[NewStep] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    usage: Usage | None = None
    model_calls: int = 0
    # A checkpoint after this write: (step index, finish reason); the message
    # count is the run's after the append.
    checkpoint: tuple[int, str | None] | None = None
    state: dict[str, Any] | None = None
    pending: dict[str, Any] | None = _UNSET
    status: RunStatus | None = None
    output: str | None = None
    error: RunError | None = None
    waiting: WaitPoint | None = _UNSET
    release_claim: bool = False
    # False: the write may be lost if the database itself crashes (never if only
    # the writer does), with everything written after it. Only for what a
    # recovery may repeat: the tool results of a step.
    durable: bool = True


class Committed:
    """A write as committed: the run after it, and the steps it appended. The steps
    are built when first read: a write is made on every step, and most processes
    have no ``step.appended`` listener to give them to."""

    def __init__(self, run: Run, steps: Callable[[], list[Step]]) -> None:
        self.run = run
        self._steps = steps

    @functools.cached_property
    def steps(self) -> list[Step]:
        return self._steps()


@dataclass(frozen=True)
class Claimed:
    """A run this caller now owns, with the transcript it continues from (read in the claim)."""

    run: Run
    epoch: int
    transcript: Transcript


@dataclass(frozen=True)
class Transcript:
    """Everything an execution continues from."""

    messages: list[dict[str, Any]]
    checkpoint_messages: int
    checkpoint_step: int | None
    state: dict[str, Any] | None
    pending: dict[str, Any] | None
    # How many of ``messages`` come from the run this one continues (see history.py).
    base_messages: int = 0
    # What could not be read back, if anything: the run's checkpoint is corrupt.
    damaged: str | None = None


@dataclass(frozen=True)
class EffectRecord:
    tool_call_id: str
    tool_name: str
    idempotency_key: str
    done: bool
    result: Any
    is_error: bool
    # When the last attempt of the call began: the attempt a result's record names.
    started_at: datetime | None = None
    # When the attempt it took over began (its outcome unknown), if it took one over.
    taken_over: datetime | None = None
    # Of the record ``begin`` returns: what that attempt had taken over, then.
    beneath: datetime | None = None


@dataclass(frozen=True)
class RunRef:
    """Just enough of a run for the sweeps."""

    id: str
    status: RunStatus
    epoch: int
    updated_at: datetime
    claim_expires_at: datetime | None
    # Its step count, and how many of its executions were lost with their workers at
    # that step in a row before.
    step: int = 0
    losses: int = 0
    cancel_requested: bool = False


@dataclass(frozen=True)
class WaitRef:
    """A waiting run as ``tick`` lists them, before it reads any in full."""

    run_id: str
    agent: str
    token_id: str | None  # its wait point's, which a new wait point changes
    cancel_requested: bool = False  # flagged as it paused, by a process that died then


@dataclass(frozen=True)
class RunHead:
    """Which run, its status, when it was created and last changed, and how many step
    rows it has: what a watcher compares between looks, before it reads a run in full."""

    id: str
    status: RunStatus
    created_at: datetime
    updated_at: datetime
    step_count: int


class Writes(Protocol):
    """The writes every run makes, as a store's backend performs them. ``create`` and
    ``claim`` return the run table's columns (``claim`` adds the stored ``messages``);
    ``commit`` only those a write can change (``postgres.WRITE_RETURNS``)."""

    def create(
        self, new: NewRun, now: datetime, claim: tuple[str, datetime] | None = None
    ) -> dict[str, Any] | None: ...
    def claim(
        self, run_id: str, owner: str, expires_at: datetime, now: datetime
    ) -> dict[str, Any] | None: ...
    def commit(
        self, run_id: str, guard: Guard, commit: Commit, now: datetime
    ) -> dict[str, Any] | None: ...
    def release(self) -> None:
        """Give back the connections held between writes, if any."""


class Store(Protocol):
    """Runs, steps and messages as the engine reads and writes them (``SqlStore``).

    Some rules live here rather than in the engine because they must hold in the
    same transaction as the write they guard: every write of a running run names
    its status and epoch (a miss is ``None``, never a partial write); a cancel
    requested while a run runs wins over its final answer; a claim takes a run only
    in its concurrency key's turn and its thread's line; ``requeue`` of a running
    run lost with its worker counts the loss at its step. A write the
    store cannot keep (too large for one statement, text that is not UTF-8, JSON
    nested too deep) raises ``ValueError``, ``TypeError`` or ``RecursionError`` and
    stores nothing."""

    def check_schema(self) -> None: ...
    def create_run(self, new: NewRun) -> tuple[Run, bool]: ...
    def create_claimed(self, new: NewRun, owner: str, expires_at: datetime) -> Claimed | None: ...
    def get_run(self, run_id: str) -> Run: ...
    def get_runs(self, run_ids: Sequence[str]) -> list[Run]: ...
    def list_runs(
        self, status: RunStatus | None = None, agent: str | None = None, limit: int = 100
    ) -> list[Run]: ...
    def run_heads(self, status: RunStatus | None = None, limit: int = 100) -> list[RunHead]: ...
    def steps(self, run_id: str, start: int = 0) -> list[Step]: ...
    def checkpoint(self, run_id: str) -> Checkpoint | None: ...
    def transcript(self, run_id: str) -> Transcript: ...
    def pending(self, run_id: str) -> dict[str, Any] | None: ...
    def start_thread(
        self, run_id: str, epoch: int, thread: str
    ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]: ...
    def claim(self, run_id: str, owner: str, expires_at: datetime) -> Claimed | None: ...
    def claimable(self, run_id: str) -> bool: ...
    def renew_claim(self, run_id: str, epoch: int, expires_at: datetime) -> bool | None: ...
    def commit(self, run: Run, guard: Guard, commit: Commit) -> Committed | None: ...
    def request_cancel(self, run_id: str) -> Run: ...
    def retry(
        self, run_id: str, budget: Budget | None = None, request_id: str | None = None
    ) -> tuple[Run, bool]: ...
    def note_retry(self, run_id: str, request_id: str) -> bool: ...
    def thread_went_on(self, run_id: str) -> str | None: ...
    def cancels_requested(self, run_ids: list[str]) -> set[str]: ...
    def effects(self, run_id: str) -> dict[str, EffectRecord]: ...
    def begin_effect(
        self, run_id: str, epoch: int, tool_call_id: str, tool_name: str, key: str
    ) -> EffectRecord: ...
    def forget_effect(self, run_id: str, begun: EffectRecord) -> None: ...
    def finish_effect(
        self, run_id: str, epoch: int, begun: EffectRecord, result: Any, is_error: bool
    ) -> bool: ...
    def sweep_candidates(self, queued_before: datetime) -> list[RunRef]: ...
    def requeue(self, ref: RunRef, count_loss: bool = False) -> Run | None: ...
    def run_ref(self, run_id: str) -> RunRef | None: ...
    def forget_losses(self) -> int: ...
    def forget_retries(self) -> int: ...
    def next_queued(self, concurrency_key: str) -> str | None: ...
    def waiting_runs(self) -> list[WaitRef]: ...
    def close(self) -> None: ...
