"""The sweeps' reads and writes (``recover()`` and ``tick()``): which runs to look at,
a run put back to queued by the sweeper that wins it, the executions lost with
their workers counted by the step they were lost at, and the waiting runs."""

from __future__ import annotations

import logging
from datetime import datetime

import sqlalchemy as sa
from psycopg.errors import LockNotAvailable
from sqlalchemy.engine import Connection, RowMapping
from sqlalchemy.exc import OperationalError

from agentruns.runs import Run, RunStatus, utcnow
from agentruns.store import schema
from agentruns.store.base import RunRef, WaitRef
from agentruns.store.queries import in_line, in_turn, insert, literal, status_of_one
from agentruns.store.rows import aware, run_from_row

log = logging.getLogger("agentruns")

R = schema.runs
C = schema.crashes
# A run's count of losses, while it is at the step they were counted at.
_LOST_AT_ITS_STEP = sa.and_(C.c.run_id == R.c.id, C.c.at_step == R.c.step_count)

_NOT_FINAL = [status.value for status in RunStatus if not status.is_final]

# How long a sweep's requeue waits for a run's row another session holds.
_SWEEP_LOCK_WAIT_MS = 2000


# What the sweeps read of runs: with the losses counted at the run's step (none,
# for most runs; 0 once it got on, or was drained).
_REFS = sa.select(
    R.c.id,
    R.c.status,
    R.c.epoch,
    R.c.updated_at,
    R.c.claim_expires_at,
    R.c.step_count,
    R.c.cancel_requested,
    sa.func.coalesce(C.c.times, 0).label("losses"),
).select_from(R.outerjoin(C, _LOST_AT_ITS_STEP))


def _ref(r: RowMapping) -> RunRef:
    return RunRef(
        id=r["id"],
        status=RunStatus(r["status"]),
        epoch=r["epoch"],
        updated_at=aware(r["updated_at"]) or utcnow(),
        claim_expires_at=aware(r["claim_expires_at"]),
        step=r["step_count"],
        losses=r["losses"],
        cancel_requested=r["cancel_requested"],
    )


class Sweeps:
    """The sweeps of a store, read through ``reads`` and written in ``atomic``
    transactions or on ``engine`` (the store's engines)."""

    def __init__(self, reads: sa.Engine, atomic: sa.Engine, engine: sa.Engine) -> None:
        self._reads = reads
        self._atomic = atomic
        self._engine = engine

    def candidates(self, queued_before: datetime) -> list[RunRef]:
        """Interrupted and running runs, and queued runs untouched since ``queued_before``
        that are first in their key's line (the others wait for the run ahead of them
        to finish, which schedules the next: a long line is not requeued, nor sent an
        execution that can claim nothing, on every sweep)."""
        # The statuses in literals: a generic plan of parameters scanned the table.
        query = _REFS.where(
            sa.or_(
                R.c.status.in_(
                    [literal(RunStatus.INTERRUPTED.value), literal(RunStatus.RUNNING.value)]
                ),
                sa.and_(
                    R.c.status == literal(RunStatus.QUEUED.value),
                    R.c.updated_at < queued_before,
                    in_turn(),
                ),
            )
        ).order_by(R.c.created_at)
        with self._reads.connect() as conn:
            return [_ref(r) for r in conn.execute(query).mappings()]

    def ref(self, run_id: str) -> RunRef | None:
        """The run as the sweeps see it (with its losses at its step), if it exists."""
        with self._reads.connect() as conn:
            row = conn.execute(_REFS.where(R.c.id == run_id)).mappings().first()
        return _ref(row) if row is not None else None

    def requeue(self, ref: RunRef, count_loss: bool = False) -> Run | None:
        """Put a run back to queued if it is still exactly as swept (so one sweeper wins).

        ``count_loss``: the running run's execution was lost with its worker, counted
        by the run's step (``RunRef.losses``); a run drained or given up by a live
        worker ends its count."""
        stmt = R.update().where(
            R.c.id == ref.id, status_of_one == ref.status.value, R.c.epoch == ref.epoch
        )
        if ref.status == RunStatus.QUEUED:
            stmt = stmt.where(R.c.updated_at == ref.updated_at)
        elif ref.status == RunStatus.RUNNING and ref.claim_expires_at is not None:
            # Not a claim its owner renewed since it was swept (a claim that waited long
            # for a lock is renewed as soon as it is made: see the keeper).
            stmt = stmt.where(R.c.claim_expires_at == ref.claim_expires_at)
        stmt = stmt.values(
            status=RunStatus.QUEUED.value,
            claim_owner=None,
            claim_expires_at=None,
            updated_at=utcnow(),
        )
        try:
            with self._atomic.begin() as conn:
                if conn.dialect.name == "postgresql":
                    # A session cut off in the middle of a write to this run (its
                    # network gone, its server-side backend not) holds the run's row
                    # until the server notices: the sweep goes on to the next run.
                    conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{_SWEEP_LOCK_WAIT_MS}ms'")
                row = conn.execute(stmt.returning(*R.c)).mappings().first()
                self._after_requeue(conn, ref, row, count_loss)
        except OperationalError as exc:
            if not isinstance(exc.orig, LockNotAvailable):
                raise
            log.warning(
                "recover: run %s is locked by another session (one cut off mid-write?);"
                " left for a later sweep",
                ref.id,
            )
            return None
        return run_from_row(row) if row is not None else None

    def _after_requeue(
        self, conn: Connection, ref: RunRef, row: RowMapping | None, count_loss: bool
    ) -> None:
        if row is not None and count_loss:
            self._count_loss(conn, ref.id, row["step_count"])
        elif row is not None and ref.status is not RunStatus.QUEUED:
            # Drained, or given up by a live worker: not a loss, and the losses
            # before it are no longer in a row.
            conn.execute(C.delete().where(C.c.run_id == ref.id))

    def forget_losses(self) -> int:
        """Delete the counts of losses that no longer count: of runs that got on past the
        step they were lost at, settled, or are gone. Rows are written only when an
        execution is lost, so the sweep deletes them (the hot path never looks); how
        many it deleted."""
        # Said of the run as it is now (past the step, or settled: neither is undone),
        # not as "no longer at its step": a count that a requeue moved to the run's
        # next step while this deletes is read again by Postgres, its run is not, and
        # the count would be gone.
        passed = sa.exists().where(
            R.c.id == C.c.run_id,
            sa.or_(R.c.step_count > C.c.at_step, R.c.status.not_in(_NOT_FINAL)),
        )
        gone = ~sa.exists().where(R.c.id == C.c.run_id)
        with self._engine.begin() as conn:
            return int(conn.execute(C.delete().where(sa.or_(passed, gone))).rowcount or 0)

    def _count_loss(self, conn: Connection, run_id: str, at_step: int) -> None:
        """Count an execution of the run lost at ``at_step``: one more in a row there,
        or the first at a step the run got to since."""
        new = insert(C, conn.dialect.name).values(run_id=run_id, at_step=at_step, times=1)
        conn.execute(
            new.on_conflict_do_update(
                index_elements=[C.c.run_id],
                set_={
                    "times": sa.case((C.c.at_step == new.excluded.at_step, C.c.times + 1), else_=1),
                    "at_step": new.excluded.at_step,
                },
            )
        )

    def next_queued(self, concurrency_key: str) -> str | None:
        """The oldest queued run of the key, by the index of the key's line."""
        with self._reads.connect() as conn:
            row = conn.execute(
                sa.select(R.c.id)
                .where(
                    R.c.concurrency_key == concurrency_key,
                    in_line(R),
                    R.c.status == literal(RunStatus.QUEUED.value),
                )
                .order_by(R.c.created_at, R.c.id)
                .limit(1)
            ).first()
            return row[0] if row else None

    def waiting_runs(self) -> list[WaitRef]:
        """The waiting runs: ids, agents and token ids, never their wait points (a
        tick lists them every few seconds, and each holds its tool's input)."""
        query = (
            sa.select(R.c.id, R.c.agent, R.c.waiting_token, R.c.cancel_requested)
            # In a literal, as list_runs' status: a generic plan of a parameter read
            # the whole table in the primary key's order.
            .where(R.c.status == literal(RunStatus.WAITING.value))
            .order_by(R.c.created_at)
        )
        with self._reads.connect() as conn:
            return [
                WaitRef(r.id, r.agent, r.waiting_token, r.cancel_requested)
                for r in conn.execute(query)
            ]
