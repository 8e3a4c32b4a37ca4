"""Effect records (``agentruns_effects``): the intent recorded before an effect tool
is called, its result after. A recovery that finds an intent without a result
knows the call may have happened; one that finds the result returns it instead
of calling again. Both writes are fenced by the run's status and epoch."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from agentruns.errors import LeaseLostError, first_line
from agentruns.outages import DATABASE_OUTAGE
from agentruns.runs import RunStatus, utcnow
from agentruns.store import schema
from agentruns.store.base import EffectRecord
from agentruns.store.queries import insert, status_of_one
from agentruns.store.rows import aware

log = logging.getLogger("agentruns")

R = schema.runs
E = schema.effects

# Between the tries of an effect's result record (the last, from then on), and how
# long they may go on: through a failover or a restart of Postgres, which take
# seconds to tens of seconds. (Given up sooner, the call was made again once the
# database was back, though the worker held its result all along.)
_FINISH_EFFECT_PAUSES_S = (0.0, 0.25, 0.5, 1.0, 2.0)
_FINISH_EFFECT_TRIES_S = 45.0


class Effects:
    """The effect records of a store, read through ``reads`` and written in ``atomic``
    transactions (the store's engines)."""

    def __init__(self, reads: sa.Engine, atomic: sa.Engine) -> None:
        self._reads = reads
        self._atomic = atomic

    def of(self, run_id: str) -> dict[str, EffectRecord]:
        """The run's effect records, by tool call id."""
        with self._reads.connect() as conn:
            rows = conn.execute(sa.select(E).where(E.c.run_id == run_id)).mappings()
            return {r["tool_call_id"]: _record(r) for r in rows}

    def _fence(self, conn: Connection, run_id: str, epoch: int) -> None:
        if not self._holds(conn, run_id, epoch):
            raise LeaseLostError(run_id)

    def _holds(self, conn: Connection, run_id: str, epoch: int) -> bool:
        """Does the execution of ``epoch`` still hold the run? If so, the run row is
        locked for the transaction, so a new claim waits for this write."""
        result = conn.execute(
            R.update()
            .where(R.c.id == run_id, status_of_one == RunStatus.RUNNING.value, R.c.epoch == epoch)
            .values(epoch=R.c.epoch)
        )
        return result.rowcount == 1

    def begin(
        self, run_id: str, epoch: int, tool_call_id: str, tool_name: str, key: str
    ) -> EffectRecord:
        """Record the intent to call an effect tool; the record as it then stands. An
        intent recorded before without a result is an earlier attempt's: it becomes
        this one's (``started_at``, which its result's record names). A result recorded
        meanwhile (by an execution that lost the run, when its worker went on) is
        returned instead, done: the call happened, and is not to be made again.

        Sent once more on a new connection if its connection was gone: a first try
        that committed, its reply lost, left an intent the next execution took for
        an attempt whose outcome is unknown, though no call was made. A second try
        makes that intent this attempt's (with the same time: it took none over).

        The record begun says which attempt this one took over (``taken_over``) and
        which that one had (``beneath``), as they were: an attempt that says its call
        failed hands the intent back by them (``forget``)."""
        now = utcnow()
        try:
            return self._begin(run_id, epoch, tool_call_id, tool_name, key, now)
        except sa.exc.OperationalError as exc:
            if not exc.connection_invalidated:
                raise
            return self._begin(run_id, epoch, tool_call_id, tool_name, key, now)

    def _begin(
        self, run_id: str, epoch: int, tool_call_id: str, tool_name: str, key: str, now: datetime
    ) -> EffectRecord:
        with self._atomic.begin() as conn:
            self._fence(conn, run_id, epoch)
            # The intent this one takes over, as it is (locked: it stays so until then).
            before = (
                conn.execute(
                    sa.select(E.c.status, E.c.started_at, E.c.taken_over)
                    .where(E.c.run_id == run_id, E.c.tool_call_id == tool_call_id)
                    .with_for_update()
                )
                .mappings()
                .first()
            )
            intent = insert(E, self._atomic.dialect.name).values(
                run_id=run_id,
                tool_call_id=tool_call_id,
                tool_name=tool_name,
                idempotency_key=key,
                status="started",
                started_at=now,
            )
            row = (
                conn.execute(
                    intent.on_conflict_do_update(
                        index_elements=["run_id", "tool_call_id"],
                        # (Both from the row as it was.) Its own first try's intent (a
                        # reply lost) it takes nothing over from.
                        set_={
                            "started_at": intent.excluded.started_at,
                            "taken_over": sa.case(
                                (E.c.started_at == intent.excluded.started_at, E.c.taken_over),
                                else_=E.c.started_at,
                            ),
                        },
                        where=E.c.status == "started",
                    ).returning(*E.c)
                )
                .mappings()
                .first()
            )
            if row is not None:  # this attempt's intent: named by the very value bound
                took_over = before is not None and aware(before["started_at"]) != now
                beneath = aware(before["taken_over"]) if before is not None and took_over else None
                return dataclasses.replace(_record(row), started_at=now, beneath=beneath)
            done = sa.select(E).where(E.c.run_id == run_id, E.c.tool_call_id == tool_call_id)
            return _record(conn.execute(done).mappings().one())

    def finish(
        self, run_id: str, epoch: int, begun: EffectRecord, result: Any, is_error: bool
    ) -> bool:
        """Record the result of the effect call ``begin`` began (``begun``). The one write
        whose loss repeats a side effect (recovery finds an intent without a result): a
        connection that died while the tool ran (a restart, a failover, a killed
        backend) is tried again on a new one, for up to 45 s. It sets what it sets:
        safe to repeat, and safe however late (see below).

        An execution that lost the run while the tool ran (its worker paused or cut
        off past its lease) still records what its call did, then raises
        ``LeaseLostError``: the side effect happened, and the next execution returns it
        instead of calling again. Only while no attempt has a result: the run's new
        holder may have called again since, and that attempt's outcome is the one to
        keep. While that attempt is under way, a late success is recorded too (its
        outcome replaces it when it comes; if it says it failed, or never comes, the
        call still happened, and is not made a third time), but not a late error: the
        new attempt may go through, and its worker die before it records it. A fact
        about the call, not a step of the run, which it does not touch.

        The holder's own result replaces a late one, but an error never replaces a
        late success (a gateway's "duplicate key" after the first attempt charged):
        False then, and the recorded success is the call's outcome."""
        tool_call_id, attempt = begun.tool_call_id, begun.started_at
        deadline: float | None = None  # from the first failure on
        for tries in itertools.count():
            pause = _FINISH_EFFECT_PAUSES_S[min(tries, len(_FINISH_EFFECT_PAUSES_S) - 1)]
            try:
                with self._atomic.begin() as conn:
                    holds = self._holds(conn, run_id, epoch)
                    record = E.update().where(
                        E.c.run_id == run_id, E.c.tool_call_id == tool_call_id
                    )
                    if not holds:  # see above
                        record = record.where(E.c.status == "started")
                        if is_error:
                            record = record.where(E.c.started_at == attempt)
                    elif is_error:  # not over a late success
                        record = record.where(sa.or_(E.c.status == "started", E.c.is_error))
                    recorded = conn.execute(
                        record.values(
                            status="done", result=result, is_error=is_error, finished_at=utcnow()
                        )
                    ).rowcount
                if not holds:
                    raise LeaseLostError(run_id, _late(run_id, begun, bool(recorded)))
                return bool(recorded)
            except DATABASE_OUTAGE as exc:
                # Bounded: a silent server (each try waiting out its timeout) would
                # hold the execution, and its drain, for as long as it lasts.
                if deadline is None:
                    deadline = time.monotonic() + _FINISH_EFFECT_TRIES_S
                if time.monotonic() + pause > deadline:
                    raise
                if not tries:  # once, not at every try of an outage
                    log.warning(
                        "run %s: could not record the result of effect call %s (%s); trying"
                        " again for up to %d s",
                        run_id,
                        tool_call_id,
                        first_line(exc),
                        _FINISH_EFFECT_TRIES_S,
                    )
                time.sleep(pause)
        raise AssertionError("unreachable: the tries end by returning or raising")

    def forget(self, run_id: str, begun: EffectRecord) -> None:
        """Forget the attempt ``begin`` recorded (``begun``), still without a result: its
        tool raised ``FatalToolError``, saying the call failed, and the run fails with
        it. Its intent is deleted: a retry of the run calls it again (with the same
        idempotency key), as it does a tool that is no effect, instead of taking its
        outcome for unknown. But if it took over an earlier attempt's intent, whose
        outcome is unknown (``taken_over``), the intent is that attempt's again, with
        what that one had taken over (``beneath``, as ``begin`` found it): its outcome
        stays unknown, and its worker, if it lost the run and goes on, records its
        result (deleted, a retry called a third time; left as this attempt's, that
        worker's result was refused, and a person asked again about a call that had
        happened).

        An attempt a later one took over (the run's new holder's) that says it failed
        leaves that attempt what this one had taken over to hand back to, if anything:
        a person was asked again about a call known to have failed, once both said
        so. Nothing is said of an intent that is neither (of an attempt two takeovers
        ago): its outcome stays unknown."""
        mine = (
            E.c.run_id == run_id,
            E.c.tool_call_id == begun.tool_call_id,
            E.c.status == "started",
        )
        current = (*mine, E.c.started_at == begun.started_at)
        deeper: Any = sa.null()
        if begun.taken_over is not None and begun.beneath is not None:
            # (Unless the one taken over said since that it failed: see below.)
            deeper = sa.case((E.c.taken_over == begun.taken_over, begun.beneath), else_=None)
        with self._atomic.begin() as conn:
            if conn.execute(E.delete().where(*current, E.c.taken_over.is_(None))).rowcount:
                return
            handed_back = conn.execute(
                E.update()
                .where(*current, E.c.taken_over.is_not(None))
                .values(started_at=E.c.taken_over, taken_over=deeper)
            )
            if handed_back.rowcount:
                return
            # Taken over since: that attempt hands back to what this one had taken over.
            conn.execute(
                E.update()
                .where(*mine, E.c.taken_over == begun.started_at)
                .values(taken_over=begun.taken_over)
            )


def _late(run_id: str, begun: EffectRecord, recorded: bool) -> str:
    """What became of the result of an effect call its execution finished after losing
    the run (said in the worker's log: "lost the claim" alone left a reader to guess)."""
    call = f"effect call {begun.tool_call_id} ({begun.tool_name})"
    if recorded:
        return (
            f"lost the claim on run {run_id} while its {call} ran: the call's result is"
            " recorded, for the run's next execution to return (unless the run's holder,"
            " calling again meanwhile, records its own)"
        )
    return (
        f"lost the claim on run {run_id} while its {call} ran: its result is not recorded,"
        " since the run's holder made the call again"
    )


def _record(row: RowMapping) -> EffectRecord:
    return EffectRecord(
        tool_call_id=row["tool_call_id"],
        tool_name=row["tool_name"],
        idempotency_key=row["idempotency_key"],
        done=row["status"] == "done",
        result=row["result"],
        is_error=row["is_error"],
        started_at=aware(row["started_at"]),
        taken_over=aware(row["taken_over"]),
    )
