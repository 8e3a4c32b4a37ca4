"""Retries of failed runs: a failed run queued again as it stands, at most once per
request (a retry message delivered twice retries once), and whether a later run of
its thread went on without it."""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentruns.runs import Budget, Run, RunStatus, utcnow
from agentruns.store import schema
from agentruns.store.queries import insert, run_row, status_of_one
from agentruns.store.rows import run_from_row

R = schema.runs
RQ = schema.retries


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


class Retries:
    """The retries of a store, read through ``reads`` and written in ``atomic``
    transactions or on ``engine`` (the store's engines)."""

    def __init__(self, reads: sa.Engine, atomic: sa.Engine, engine: sa.Engine) -> None:
        self._reads = reads
        self._atomic = atomic
        self._engine = engine

    def retry(
        self, run_id: str, budget: Budget | None = None, request_id: str | None = None
    ) -> tuple[Run, bool]:
        """Queue a failed run again, as it stands (its checkpoint, steps, pending answers,
        effect records and usage kept; its budget replaced by ``budget`` if given): the
        run, and whether this retried it (False: it is not failed, or a later run of its
        thread has started: it went on from the thread's runs before this one; or
        ``request_id``, the request asking, was answered already: ``note``).

        One statement decides: two retries queue the run once. A request that queues
        the run is noted with it, in one transaction."""
        try:
            with self._atomic.begin() as conn:
                return self._retry(conn, run_id, budget, request_id)
        except _AnsweredAlready:  # rolled back
            with self._reads.connect() as conn:
                return run_from_row(run_row(conn, run_id)), False

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
            return run_from_row(run_row(conn, run_id)), False
        # Another try of the request noted it since this statement's snapshot (it
        # queued the run, which then failed again, while this waited on its row):
        # answered already, and this retry is undone.
        if request_id is not None and not self._note(conn, run_id, request_id):
            raise _AnsweredAlready
        return run_from_row(row), True

    def note(self, run_id: str, request_id: str) -> bool:
        """Note that the request ``request_id`` was answered (the run nudged, or the
        retry refused): False if it was already, in the last ``RETRY_REQUEST_DAYS``."""
        with self._atomic.begin() as conn:
            return self._note(conn, run_id, request_id)

    def _note(self, conn: Connection, run_id: str, request_id: str) -> bool:
        now = utcnow()
        new = insert(RQ, conn.dialect.name).values(
            run_id=run_id, request_id=_request(request_id), at=now
        )
        noted = conn.execute(
            new.on_conflict_do_update(
                index_elements=[RQ.c.run_id, RQ.c.request_id],
                set_={"at": now},
                where=RQ.c.at < _week_ago(),  # long forgotten, if not yet deleted
            ).returning(RQ.c.run_id)  # (an INSERT's rowcount is not told on Postgres)
        )
        return noted.first() is not None

    def forget(self) -> int:
        """Delete the retries' requests older than ``RETRY_REQUEST_DAYS`` (a message
        is not delivered again that late); how many."""
        with self._engine.begin() as conn:
            return int(conn.execute(RQ.delete().where(RQ.c.at < _week_ago())).rowcount or 0)

    def went_on(self, run_id: str) -> str | None:
        """The first run of the run's thread created after it that has started, if any."""
        me = R.alias("me")
        query = _started_after(me).where(me.c.id == run_id).limit(1)
        with self._reads.connect() as conn:
            return conn.execute(query).scalar()


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
