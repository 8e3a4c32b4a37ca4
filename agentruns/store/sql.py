"""SqlStore: the store on Postgres, or SQLite embedded, and the engine's only way to
the database. The package's other modules are its parts: the hot-path writes
(``postgres.py``, ``transactions.py``), the effect records (``effects.py``),
the sweeps' reads and requeues (``sweeps.py``), the retries (``retries.py``),
connections (``connect.py``, ``held.py``), the tables (``schema.py``), the query
fragments both databases share (``queries.py``) and the read of a thread's history
(``history.py``)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
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
from agentruns.store.queries import claimable, literal, run_row, status_of_one
from agentruns.store.retries import Retries
from agentruns.store.rows import (
    aware,
    first_problem,
    new_steps,
    read_run,
    run_from_row,
    run_updated,
    step_from_row,
)
from agentruns.store.sweeps import Sweeps
from agentruns.store.transactions import Transactions

log = logging.getLogger("agentruns")

R = schema.runs
S = schema.steps

_NOT_FINAL = [status.value for status in RunStatus if not status.is_final]


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
        self._sweeps = Sweeps(self._reads, self._atomic, self.engine)
        self._retries = Retries(self._reads, self._atomic, self.engine)
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
            key = run_row(conn, run_id)["key"]
            query = sa.select(S).where(S.c.run_key == key)
            if start:
                query = query.where(S.c.idx >= start)
            rows = conn.execute(query.order_by(S.c.idx))
            return [step_from_row(run_id, r) for r in rows.mappings()]

    def checkpoint(self, run_id: str) -> Checkpoint | None:
        try:
            with self._reads.connect() as conn:
                row = run_row(conn, run_id)
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
            return self._transcript(conn, run_row(conn, run_id))

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
            return run_from_row(row if row is not None else run_row(conn, run_id))

    # -- retries (retries.py) --------------------------------------------------

    def retry(
        self, run_id: str, budget: Budget | None = None, request_id: str | None = None
    ) -> tuple[Run, bool]:
        return self._retries.retry(run_id, budget, request_id)

    def note_retry(self, run_id: str, request_id: str) -> bool:
        return self._retries.note(run_id, request_id)

    def forget_retries(self) -> int:
        return self._retries.forget()

    def thread_went_on(self, run_id: str) -> str | None:
        return self._retries.went_on(run_id)

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

    # -- sweeps (sweeps.py) ----------------------------------------------------

    def sweep_candidates(self, queued_before: datetime) -> list[RunRef]:
        return self._sweeps.candidates(queued_before)

    def run_ref(self, run_id: str) -> RunRef | None:
        return self._sweeps.ref(run_id)

    def requeue(self, ref: RunRef, count_loss: bool = False) -> Run | None:
        return self._sweeps.requeue(ref, count_loss)

    def forget_losses(self) -> int:
        return self._sweeps.forget_losses()

    def next_queued(self, concurrency_key: str) -> str | None:
        return self._sweeps.next_queued(concurrency_key)

    def waiting_runs(self) -> list[WaitRef]:
        return self._sweeps.waiting_runs()


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
