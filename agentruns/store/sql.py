"""SqlStore: the store on Postgres, or SQLite embedded, and the engine's only way to
the database. The package's other modules are its parts: the hot-path writes
(``postgres.py``, ``transactions.py``), the effect records (``effects.py``),
connections (``connect.py``, ``held.py``), the tables (``schema.py``), the query
fragments both databases share (``queries.py``) and the read of a thread's history
(``history.py``)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from psycopg.errors import LockNotAvailable
from sqlalchemy.engine import Connection, RowMapping
from sqlalchemy.exc import OperationalError, ProgrammingError

from agentruns import pending as pending_
from agentruns.errors import (
    InvalidCheckpointError,
    LeaseLostError,
    NotMigratedError,
    RunNotFoundError,
)
from agentruns.migrations import HEAD, REVISIONS, current_revision, works_here
from agentruns.runs import (
    Budget,
    Checkpoint,
    Run,
    RunStatus,
    Step,
    utcnow,
)
from agentruns.store import history, schema
from agentruns.store.base import (
    Claimed,
    Commit,
    Committed,
    EffectRecord,
    Guard,
    NewRun,
    RunHead,
    RunRef,
    Transcript,
    WaitRef,
    Writes,
)
from agentruns.store.connect import READ_ONLY, make_engine, missing_sqlite_file, shown_url
from agentruns.store.effects import Effects
from agentruns.store.postgres import Statements
from agentruns.store.queries import claimable, in_line, in_turn, insert, literal, status_of_one
from agentruns.store.rows import (
    aware,
    first_problem,
    new_steps,
    read_run,
    run_from_row,
    run_updated,
    step_from_row,
)
from agentruns.store.transactions import Transactions

log = logging.getLogger("agentruns")

R = schema.runs
S = schema.steps
E = schema.effects
C = schema.crashes
RQ = schema.retries
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


def _started_after(run: Any) -> Any:
    """The runs of ``run``'s thread created after it that have started, and those that
    started after it did, oldest first (a run of a thread starts from the thread's
    completed runs as they then are). The second are runs stored late: created
    before it, committed after it had started (a write that waited on a lock)."""
    later = R.alias("later")
    return (
        sa.select(later.c.id)
        .where(
            later.c.thread == run.c.thread,
            sa.or_(
                sa.tuple_(later.c.created_at, later.c.id) > sa.tuple_(run.c.created_at, run.c.id),
                later.c.started_at > run.c.started_at,
            ),
            later.c.started_at.is_not(None),  # claimed once (not one cancelled queued)
        )
        .order_by(later.c.created_at, later.c.id)
    )


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


class SqlStore:
    """Runs, steps, messages and effect records in SQL, every write to a run guarded."""

    def __init__(self, url: str, **engine_kwargs: Any) -> None:
        self.url = url
        postgres = sa.make_url(url).get_backend_name() == "postgresql"
        if postgres:
            # Postgres connections autocommit: the hot path is single statements
            # (``writes``), and reads and one-statement writes need no BEGIN and
            # COMMIT or ROLLBACK round trips. A read of two statements bounds the
            # second by the first (a message count), not by a shared snapshot.
            engine_kwargs.setdefault("isolation_level", "AUTOCOMMIT")
        self.engine = make_engine(url, **engine_kwargs)
        # The writes every run makes (create, claim, guarded writes): one statement
        # each on Postgres, a transaction each on SQLite. Same operations, same rows.
        self.writes: Writes = Statements(self.engine) if postgres else Transactions(self.engine)
        # What must be atomic and takes several statements runs in a transaction.
        self._atomic = (
            self.engine.execution_options(isolation_level="READ COMMITTED")
            if postgres
            else self.engine
        )
        # Every ``connect()`` block of this module reads, and only reads.
        self._reads = self.engine.execution_options(**{READ_ONLY: True})
        self._effects = Effects(self._reads, self._atomic)
        self._checked = False

    # -- schema ------------------------------------------------------------

    def check_schema(self) -> None:
        """Refuse to work on a database that ``agentruns migrate`` has not brought up to date."""
        if self._checked:
            return
        if missing_sqlite_file(self.engine.url) is not None:  # not to create it, empty
            raise NotMigratedError(
                f"the database {self._safe_url()} does not exist: run `agentruns migrate`"
                " to create it (or check its URL)"
            )
        try:
            with self._reads.connect() as conn:
                current = current_revision(conn)
                floor = works_here(conn, current)
        except (OperationalError, ProgrammingError) as exc:
            if isinstance(exc, OperationalError) and (
                exc.connection_invalidated or exc.statement in (None, "connect")
            ):
                raise  # the database is away, not unmigrated: an outage, said as one
            raise NotMigratedError(
                f"cannot read the schema version of {self._safe_url()}: {exc.orig}"
            ) from exc
        if floor is not None:
            # A newer release migrated it, and says this one's statements still work.
            log.info(
                "the database %s is at schema %s, newer than this release of agentruns"
                " knows (%s); it works with releases from schema %s on",
                self._safe_url(),
                current,
                HEAD,
                floor,
            )
            self._checked = True
            return
        if current is not None and current not in REVISIONS:
            # `agentruns migrate` here would not help: it knows no way from there.
            raise NotMigratedError(
                f"the database {self._safe_url()} is at schema {current}, newer than this "
                f"release of agentruns knows (its newest is {HEAD}): a newer "
                "release migrated it; run that release here too"
            )
        if current != HEAD:
            raise NotMigratedError(
                f"the database {self._safe_url()} is not migrated "
                f"(at {current or 'nothing'}, need {HEAD}): run `agentruns migrate`"
            )
        self._checked = True

    def migrate(self) -> str | None:
        """Apply the packaged migrations (what ``agentruns migrate`` does); returns the revision."""
        from agentruns.migrate import migrate

        self._checked = False
        return migrate(self.url)

    def _safe_url(self) -> str:
        return shown_url(self.engine.url)

    def close(self) -> None:
        self.writes.release()
        self.engine.dispose()

    # -- runs --------------------------------------------------------------

    def create_run(self, new: NewRun) -> tuple[Run, bool]:
        """Store a queued run; with an idempotency key already stored, that run instead."""
        row = self.writes.create(new, utcnow())
        if row is not None:
            return run_from_row(row), True
        # The run its key names; a run without a key, only a first try of this very
        # create that committed before its connection went (see Statements.create).
        same = (
            R.c.id == new.id
            if new.idempotency_key is None
            else (R.c.idempotency_key == new.idempotency_key)
        )
        with self._reads.connect() as conn:
            existing = conn.execute(sa.select(R).where(same)).mappings().one()
        return run_from_row(existing), False

    def create_claimed(self, new: NewRun, owner: str, expires_at: datetime) -> Claimed | None:
        """Store a run already claimed by ``owner`` (running, epoch 1), for the worker that
        executes it at once; None, storing nothing, if its idempotency key is taken."""
        if new.concurrency_key is not None:
            raise ValueError("a run with a concurrency key is claimed in turn, not on creation")
        row = self.writes.create(new, utcnow(), (owner, expires_at))
        if row is None:
            # The key is taken; or the run is this create's own, stored by a first try
            # that committed before its connection went (see Statements.create).
            ours = sa.select(R).where(
                R.c.id == new.id,
                status_of_one == RunStatus.RUNNING.value,
                R.c.claim_owner == owner,
                R.c.claim_expires_at == expires_at,
            )
            with self._reads.connect() as conn:
                stored = conn.execute(ours).mappings().first()
            if stored is None:
                return None
            row = dict(stored)
        start = self._transcript_of(row, [])
        return Claimed(run=run_from_row(row), epoch=row["epoch"], transcript=start)

    def _insert(self, table: sa.Table) -> Any:
        return insert(table, self.engine.dialect.name)

    def get_run(self, run_id: str) -> Run:
        with self._reads.connect() as conn:
            row = conn.execute(sa.select(R).where(R.c.id == run_id)).mappings().first()
        if row is None:
            raise RunNotFoundError(run_id)
        return run_from_row(row)

    def get_runs(self, run_ids: Sequence[str]) -> list[Run]:
        """Those of the runs that exist, in one read (a hand-damaged one is left out)."""
        if not run_ids:
            return []
        with self._reads.connect() as conn:
            rows = conn.execute(sa.select(R).where(R.c.id.in_(list(run_ids))).order_by(R.c.key))
            return _readable(rows.mappings())

    def list_runs(
        self, status: RunStatus | None = None, agent: str | None = None, limit: int = 100
    ) -> list[Run]:
        """The newest runs first, of a status and an agent if given."""
        with self._reads.connect() as conn:
            return _readable(conn.execute(_newest(sa.select(R), status, agent, limit)).mappings())

    def run_heads(self, status: RunStatus | None = None, limit: int = 100) -> list[RunHead]:
        """As ``list_runs``, only the id, status, times and step count of each run (a
        watcher's look)."""
        columns = sa.select(R.c.id, R.c.status, R.c.created_at, R.c.updated_at, R.c.step_count)
        heads = []
        with self._reads.connect() as conn:
            for row in conn.execute(_newest(columns, status, None, limit)):
                try:
                    run_status = RunStatus(row.status)
                except ValueError:
                    continue  # damaged by hand: list_runs skips it too, saying so
                created = aware(row.created_at) or utcnow()  # (never None: NOT NULL)
                updated = aware(row.updated_at) or utcnow()
                heads.append(RunHead(row.id, run_status, created, updated, row.step_count))
        return heads

    def steps(self, run_id: str, start: int = 0) -> list[Step]:
        """The run's steps from index ``start`` on (a watcher reads only those it has
        not shown: a long run's whole list on every step made following it quadratic)."""
        with self._reads.connect() as conn:
            key = self._require(conn, run_id)["key"]
            query = sa.select(S).where(S.c.run_key == key)
            if start:
                query = query.where(S.c.idx >= start)
            rows = conn.execute(query.order_by(S.c.idx))
            return [step_from_row(run_id, r) for r in rows.mappings()]

    def _require(self, conn: Connection, run_id: str) -> RowMapping:
        row = conn.execute(sa.select(R).where(R.c.id == run_id)).mappings().first()
        if row is None:
            raise RunNotFoundError(run_id)
        return row

    def checkpoint(self, run_id: str) -> Checkpoint | None:
        try:
            with self._reads.connect() as conn:
                row = self._require(conn, run_id)
                if row["checkpoint_step"] is None:
                    return None
                messages = history.messages(conn, row["key"], row["checkpoint_messages"])
            return Checkpoint(
                run_id=run_id,
                step_index=row["checkpoint_step"],
                messages=messages,
                finish_reason=row["checkpoint_reason"],
                state=row["state"],
                created_at=aware(row["checkpoint_at"]),
            )
        except ValueError as exc:  # rows edited by hand: not JSON, or not a message
            raise InvalidCheckpointError(
                f"run {run_id}'s checkpoint cannot be read: {first_problem(exc)}"
            ) from None

    def transcript(self, run_id: str) -> Transcript:
        with self._reads.connect() as conn:
            return self._transcript(conn, self._require(conn, run_id))

    def _transcript(self, conn: Connection, row: RowMapping) -> Transcript:
        # A run with no stored messages yet needs no query for them.
        return self._transcript_of(row, history.messages(conn, row["key"], row["message_count"]))

    @staticmethod
    def _transcript_of(
        row: RowMapping | dict[str, Any], messages: list[Any], damaged: str | None = None
    ) -> Transcript:
        # JSON objects, unless edited by hand.
        state = row["state"]
        problem = pending_.damaged(row["pending"])
        if state is not None and not isinstance(state, dict):
            problem = f"state is not a valid object ({state!r:.80})"
        elif problem is not None:
            problem = f"pending {problem}"
        if damaged is None and problem is not None:
            damaged = f"run {row['id']}'s row: its {problem}"
        return Transcript(
            messages=messages,
            checkpoint_messages=row["checkpoint_messages"] or 0,
            checkpoint_step=row["checkpoint_step"],
            state=row["state"],
            pending=row["pending"],
            base_messages=row["base_count"] or 0,
            damaged=damaged,
        )

    def pending(self, run_id: str) -> dict[str, Any] | None:
        with self._reads.connect() as conn:
            row = conn.execute(sa.select(R.c.pending).where(R.c.id == run_id)).first()
        if row is None:
            raise RunNotFoundError(run_id)
        return row[0]  # type: ignore[no-any-return]

    def start_thread(
        self, run_id: str, epoch: int, thread: str
    ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """Make a claimed run with no messages continue the thread's latest completed
        run: its transcript, and its state, which the run keeps from now on (none:
        ``[]`` and None, and nothing changes).

        Guarded as every write: ``LeaseLostError`` if this epoch no longer owns the run."""
        with self._atomic.begin() as conn:
            prev = conn.execute(
                sa.select(R.c.key, R.c.checkpoint_messages, R.c.state)
                .where(
                    R.c.thread == thread,
                    R.c.status == RunStatus.COMPLETED.value,
                    R.c.id != run_id,
                )
                # The last to complete: a run that waited for an approval while the
                # thread went on may complete after runs stored later.
                .order_by(R.c.finished_at.desc())
                .limit(1)
            ).first()
            base_key, base_count, state = (
                (prev[0], prev[1] or 0, prev[2]) if prev is not None else (None, 0, None)
            )
            update = R.update().where(
                R.c.id == run_id,
                status_of_one == RunStatus.RUNNING.value,
                R.c.epoch == epoch,
                R.c.message_count == 0,
            )
            if base_key is not None:
                update = update.values(
                    base_key=base_key, base_count=base_count, message_count=base_count
                )
                if isinstance(state, dict):
                    # A later execution (after a crash) starts from the run's own state.
                    update = update.values(state=state)
                else:
                    state = None  # none, or damaged by hand: the agent's default
            else:
                update = update.values(epoch=R.c.epoch)  # only the guard
            if conn.execute(update).rowcount != 1:
                raise LeaseLostError(run_id)
            if base_key is None:
                return [], None
            return history.messages(conn, base_key, base_count), state

    # -- claims and guarded writes -------------------------------------------

    def claim(self, run_id: str, owner: str, expires_at: datetime) -> Claimed | None:
        """queued -> running with a new epoch; None if not queued or its key is busy.

        The start point comes with the claim: no second read of the run row."""
        row = self.writes.claim(run_id, owner, expires_at, utcnow())
        if row is None:
            return None
        # A row damaged by hand reads, and the execution fails it (invalid_checkpoint).
        run, damaged = read_run(row)
        start = self._transcript_of(row, row["messages"] or [], damaged or row.get("damaged"))
        return Claimed(run=run, epoch=row["epoch"], transcript=start)

    def claimable(self, run_id: str) -> bool:
        """Whether a claim of the run would succeed now: queued, no run of its key
        running, and none older of its key queued or interrupted (see claim.sql)."""
        with self._reads.connect() as conn:
            return conn.execute(claimable(run_id)).first() is not None

    def cancels_requested(self, run_ids: list[str]) -> set[str]:
        """Which of these runs were asked to cancel (one read, for all of them)."""
        if not run_ids:
            return set()
        query = sa.select(R.c.id).where(R.c.id.in_(run_ids), R.c.cancel_requested)
        with self._reads.connect() as conn:
            return {row[0] for row in conn.execute(query)}

    def renew_claim(self, run_id: str, epoch: int, expires_at: datetime) -> bool | None:
        """Extend the claim; None if this epoch lost the run, else its ``cancel_requested``."""
        with self.engine.begin() as conn:
            row = conn.execute(
                R.update()
                .where(
                    R.c.id == run_id,
                    status_of_one == RunStatus.RUNNING.value,
                    R.c.epoch == epoch,
                )
                .values(claim_expires_at=expires_at)
                .returning(R.c.cancel_requested)
            ).first()
            return None if row is None else bool(row[0])

    def commit(self, run: Run, guard: Guard, commit: Commit) -> Committed | None:
        """Apply one write to ``run`` atomically if it still matches ``guard``.

        A running guard that matches no row means another engine owns the run:
        that raises ``LeaseLostError``. Other guards return None.
        """
        try:
            row = self.writes.commit(run.id, guard, commit, utcnow())
        except sa.exc.IntegrityError:
            # Only an append can collide: the run's rows go past its counters.
            raise InvalidCheckpointError(
                f"run {run.id} holds more steps or messages than its counters say (edited"
                " by hand?): this write's cannot be appended after them"
            ) from None
        if row is None:
            if guard.status == RunStatus.RUNNING:
                raise LeaseLostError(run.id)
            return None
        return Committed(run_updated(run, row), lambda: new_steps(row, run.id, commit))

    def request_cancel(self, run_id: str) -> Run:
        """Cancel a queued, waiting or interrupted run at once; flag a running one.

        One statement decides by the status it updates: a run that changes status
        meanwhile (a running run pausing) is decided by its new status, as Postgres
        re-reads a row it waited for (SQLite has one writer at a time)."""
        now = utcnow()
        running = status_of_one == RunStatus.RUNNING.value

        def unless_running(stopped: Any, column: sa.Column[Any]) -> Any:
            return sa.case((running, column), else_=stopped)

        with self._atomic.begin() as conn:
            row = (
                conn.execute(
                    R.update()
                    .where(R.c.id == run_id, status_of_one.in_(_NOT_FINAL))
                    .values(
                        status=unless_running(RunStatus.CANCELLED.value, R.c.status),
                        cancel_requested=sa.case((running, True), else_=R.c.cancel_requested),
                        waiting=unless_running(sa.null(), R.c.waiting),
                        waiting_token=unless_running(sa.null(), R.c.waiting_token),
                        claim_owner=unless_running(sa.null(), R.c.claim_owner),
                        claim_expires_at=unless_running(sa.null(), R.c.claim_expires_at),
                        updated_at=now,
                        finished_at=unless_running(now, R.c.finished_at),
                    )
                    .returning(*R.c)
                )
                .mappings()
                .first()
            )
            return run_from_row(row if row is not None else self._require(conn, run_id))

    def retry(
        self, run_id: str, budget: Budget | None = None, request_id: str | None = None
    ) -> tuple[Run, bool]:
        """Queue a failed run again, as it stands (its checkpoint, steps, pending answers,
        effect records and usage kept; its budget replaced by ``budget`` if given): the
        run, and whether this retried it (False: it is not failed, or a later run of its
        thread has started: it went on from the thread's runs before this one; or
        ``request_id``, the request asking, was answered already: ``note_retry``).

        One statement decides: two retries queue the run once. A request that queues
        the run is noted with it, in one transaction."""
        try:
            with self._atomic.begin() as conn:
                return self._retry(conn, run_id, budget, request_id)
        except _AnsweredAlready:  # rolled back
            return self.get_run(run_id), False

    def _retry(
        self, conn: Connection, run_id: str, budget: Budget | None, request_id: str | None
    ) -> tuple[Run, bool]:
        went_on = sa.exists(_started_after(R).with_only_columns(sa.literal(1)))
        asked = () if request_id is None else (~_noted(run_id, request_id),)
        queued = R.update().where(
            R.c.id == run_id,
            status_of_one == RunStatus.FAILED.value,
            sa.or_(R.c.thread.is_(None), ~went_on),
            *asked,
        )
        row = (
            conn.execute(
                queued.values(
                    status=RunStatus.QUEUED.value,
                    error=sa.null(),
                    output=None,
                    cancel_requested=False,
                    claim_owner=None,
                    claim_expires_at=None,
                    updated_at=utcnow(),
                    finished_at=None,
                    **({} if budget is None else {"budget": budget.model_dump(mode="json")}),
                ).returning(*R.c)
            )
            .mappings()
            .first()
        )
        if row is None:
            return run_from_row(self._require(conn, run_id)), False
        # Another try of the request noted it since this statement's snapshot (it
        # queued the run, which then failed again, while this waited on its row):
        # answered already, and this retry is undone.
        if request_id is not None and not self._note(conn, run_id, request_id):
            raise _AnsweredAlready
        return run_from_row(row), True

    def note_retry(self, run_id: str, request_id: str) -> bool:
        """Note that the request ``request_id`` was answered (the run nudged, or the
        retry refused): False if it was already, in the last ``RETRY_REQUEST_DAYS``."""
        with self._atomic.begin() as conn:
            return self._note(conn, run_id, request_id)

    def _note(self, conn: Connection, run_id: str, request_id: str) -> bool:
        now = utcnow()
        insert = self._insert(RQ).values(run_id=run_id, request_id=_request(request_id), at=now)
        noted = conn.execute(
            insert.on_conflict_do_update(
                index_elements=[RQ.c.run_id, RQ.c.request_id],
                set_={"at": now},
                where=RQ.c.at < _week_ago(),  # long forgotten, if not yet deleted
            ).returning(RQ.c.run_id)  # (an INSERT's rowcount is not told on Postgres)
        )
        return noted.first() is not None

    def forget_retries(self) -> int:
        """Delete the retries' requests older than ``RETRY_REQUEST_DAYS`` (a message
        is not delivered again that late); how many."""
        with self.engine.begin() as conn:
            return int(conn.execute(RQ.delete().where(RQ.c.at < _week_ago())).rowcount or 0)

    def thread_went_on(self, run_id: str) -> str | None:
        """The first run of the run's thread created after it that has started, if any."""
        me = R.alias("me")
        query = _started_after(me).where(me.c.id == run_id).limit(1)
        with self._reads.connect() as conn:
            return conn.execute(query).scalar()

    # -- effect records --------------------------------------------------------

    def effects(self, run_id: str) -> dict[str, EffectRecord]:
        return self._effects.of(run_id)

    def begin_effect(
        self, run_id: str, epoch: int, tool_call_id: str, tool_name: str, key: str
    ) -> EffectRecord:
        return self._effects.begin(run_id, epoch, tool_call_id, tool_name, key)

    def forget_effect(self, run_id: str, begun: EffectRecord) -> None:
        return self._effects.forget(run_id, begun)

    def finish_effect(
        self, run_id: str, epoch: int, begun: EffectRecord, result: Any, is_error: bool
    ) -> bool:
        return self._effects.finish(run_id, epoch, begun, result, is_error)

    # -- sweeps ----------------------------------------------------------------

    def sweep_candidates(self, queued_before: datetime) -> list[RunRef]:
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

    def run_ref(self, run_id: str) -> RunRef | None:
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
        with self.engine.begin() as conn:
            return int(conn.execute(C.delete().where(sa.or_(passed, gone))).rowcount or 0)

    def _count_loss(self, conn: Connection, run_id: str, at_step: int) -> None:
        """Count an execution of the run lost at ``at_step``: one more in a row there,
        or the first at a step the run got to since."""
        insert = self._insert(C).values(run_id=run_id, at_step=at_step, times=1)
        conn.execute(
            insert.on_conflict_do_update(
                index_elements=[C.c.run_id],
                set_={
                    "times": sa.case(
                        (C.c.at_step == insert.excluded.at_step, C.c.times + 1), else_=1
                    ),
                    "at_step": insert.excluded.at_step,
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


def _newest(query: Any, status: RunStatus | None, agent: str | None, limit: int) -> Any:
    """``query`` for the newest runs first, of a status and an agent if given: each
    through an index on the creation time (schema.py)."""
    query = query.order_by(R.c.created_at.desc(), R.c.id).limit(limit)
    if status is not None:
        # In a literal, the planner weighs the status by its share of the runs:
        # with a parameter's, a prepared statement's generic plan read the
        # creation times of all runs backwards for the few waiting ones.
        query = query.where(R.c.status == literal(RunStatus(status).value))
    if agent is not None:
        query = query.where(R.c.agent == agent)
    return query


def _readable(rows: Iterable[RowMapping]) -> list[Run]:
    """The runs of the rows, without those a hand edit left unreadable (logged)."""
    runs = []
    for row in rows:
        try:
            runs.append(run_from_row(row))
        except InvalidCheckpointError as exc:
            log.warning("skipped: %s", exc)
    return runs


def _request(request_id: str) -> str:
    """A retry's request id as it is kept: one longer than the column holds, or that the
    database may not store as text (a NUL, a lone surrogate), hashed."""
    if len(request_id) <= schema.REQUEST_ID_LENGTH and request_id.isprintable():
        return request_id
    return "sha256:" + hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()


def _week_ago() -> datetime:
    return utcnow() - timedelta(days=schema.RETRY_REQUEST_DAYS)


def _noted(run_id: str, request_id: str) -> sa.Exists:
    """The request was answered, in the last ``RETRY_REQUEST_DAYS``."""
    return sa.exists().where(
        RQ.c.run_id == run_id, RQ.c.request_id == _request(request_id), RQ.c.at >= _week_ago()
    )


class _AnsweredAlready(Exception):
    """A retry's request was noted by another try of it meanwhile: roll back."""
