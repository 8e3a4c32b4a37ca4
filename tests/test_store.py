"""The store's contract: migrations, guarded writes, the one-running-per-key index."""

from __future__ import annotations

import gc
import os
import re
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from agentruns import LeaseLostError, RunStatus, SqlStore, TriggerEnvelope
from agentruns.errors import AgentrunsError
from agentruns.runs import Run, utcnow
from agentruns.settings import Settings
from agentruns.store.base import Commit, Guard, NewStep
from tests.conftest import database_away, drop_connections, free_port, wait_for
from tests.support.rows import new_run, soon


def _running(store: SqlStore) -> tuple[Run, Guard]:
    run, _ = store.create_run(new_run())
    claimed = store.claim(run.id, "x", soon())
    assert claimed is not None
    return claimed.run, Guard(status=RunStatus.RUNNING, epoch=claimed.epoch)


def _step(name: str = "t") -> NewStep:
    now = utcnow()
    return NewStep(kind="tool", name=name, started_at=now, finished_at=now)


def test_postgres_connections_give_up_on_a_server_gone_silent(db_url: str) -> None:
    # A host that dies or a partition closes nothing: without these, a statement
    # waited for the kernel's TCP timeout (about 15 minutes), its run and a drain
    # with it. What the URL sets itself wins.
    for url, connect_timeout in ((db_url, "10"), (f"{db_url}?connect_timeout=3", "3")):
        store = SqlStore(url)
        with store.engine.connect() as conn:
            params = conn.connection.driver_connection.info.get_parameters()  # type: ignore[union-attr]
        store.close()
        assert params["connect_timeout"] == connect_timeout
        assert params["tcp_user_timeout"] == "30000"
        assert (params["keepalives"], params["keepalives_idle"]) == ("1", "10")


@pytest.mark.parametrize("url", ["db_url", "sqlite_url"])
def test_a_running_run_is_not_requeued_once_its_claim_was_renewed_since_the_sweep(
    request: pytest.FixtureRequest, url: str
) -> None:
    # The sweep read an expired claim; its owner renewed it (a claim that had waited
    # for a lock, renewed before it ran anything); the requeue went through anyway,
    # guarded by status and epoch alone, and two engines ran the run.
    store = SqlStore(request.getfixturevalue(url))
    run, _ = store.create_run(new_run())
    claimed = store.claim(run.id, "late", utcnow() - timedelta(seconds=1))
    assert claimed is not None
    ref = next(r for r in store.sweep_candidates(utcnow()) if r.id == run.id)
    assert store.renew_claim(run.id, claimed.epoch, soon()) is False  # renewed
    assert store.requeue(ref) is None
    assert store.get_run(run.id).status is RunStatus.RUNNING
    ref = next(r for r in store.sweep_candidates(utcnow()) if r.id == run.id)
    assert store.requeue(ref) is not None  # as swept: requeued
    store.close()


def test_a_write_with_a_stale_epoch_raises_lease_lost_and_writes_nothing(db_url: str) -> None:
    store = SqlStore(db_url)
    run, _ = store.create_run(new_run())
    first = store.claim(run.id, "one", soon())
    assert first is not None
    ref = next(r for r in store.sweep_candidates(utcnow()) if r.id == run.id)
    requeued = store.requeue(ref)
    assert requeued is not None and requeued.status is RunStatus.QUEUED and requeued.claim is None
    second = store.claim(run.id, "two", soon())
    assert second is not None and second.epoch == first.epoch + 1

    now = utcnow()
    step = NewStep(kind="llm", name="m", started_at=now, finished_at=now)
    with pytest.raises(LeaseLostError):
        store.commit(
            run,
            Guard(status=RunStatus.RUNNING, epoch=first.epoch),
            Commit(steps=[step], messages=[{"role": "user", "content": "x"}]),
        )
    assert store.steps(run.id) == []
    assert store.transcript(run.id).messages == []
    assert store.renew_claim(run.id, first.epoch, soon()) is None
    assert store.renew_claim(run.id, second.epoch, soon()) is False
    store.close()


def test_a_store_on_a_pool_of_the_callers_choice_works(db_url: str) -> None:
    # The store's pool sizes were passed to any pool: NullPool (one connection per
    # checkout, as behind PgBouncer) refused them, and the store could not be made.
    SqlStore(db_url, poolclass=None).close()  # None: the store's own, as if not given
    for shared in (sa.pool.StaticPool, sa.pool.SingletonThreadPool):  # threads collide
        with pytest.raises(ValueError, match="takes a QueuePool or a NullPool"):
            SqlStore(db_url, poolclass=shared)
    store = SqlStore(db_url, poolclass=sa.pool.NullPool)
    try:
        run, _ = store.create_run(new_run())
        claimed = store.claim(run.id, "one", soon())
        assert claimed is not None
        now = utcnow()
        step = NewStep(kind="llm", name="m", started_at=now, finished_at=now)
        guard = Guard(status=RunStatus.RUNNING, epoch=claimed.epoch)
        assert store.commit(claimed.run, guard, Commit(steps=[step])) is not None
        assert [s.kind for s in store.steps(run.id)] == ["llm"]
    finally:
        store.close()


@pytest.mark.parametrize("url", ["db_url", "sqlite_url"])
@pytest.mark.parametrize(
    "case", ["handed back", "both failed", "gone before", "two back", "three back", "sent again"]
)
def test_an_effect_call_that_says_it_failed_hands_its_intent_back_only_to_an_unknown_one(
    request: pytest.FixtureRequest, url: str, case: str
) -> None:
    # A call that raised FatalToolError after taking over an earlier attempt's intent
    # handed it back to that attempt: also when that attempt had said it failed too
    # (both failed), or had deleted its intent before this one began (gone before),
    # and a person was asked about a call known to have failed. Handing back by what
    # it had read before it began, it lost a level of a chain that changed meanwhile,
    # and a later failure deleted an intent whose outcome was unknown (three back).
    store = SqlStore(request.getfixturevalue(url))
    run, _ = store.create_run(new_run())

    def claim(owner: str) -> int:
        claimed = store.claim(run.id, owner, utcnow() - timedelta(seconds=1))
        assert claimed is not None
        return claimed.epoch

    def lapse() -> None:  # its lease lapses: the next takes over
        ref = next(r for r in store.sweep_candidates(utcnow()) if r.id == run.id)
        assert store.requeue(ref) is not None

    def attempt(owner: str) -> Any:
        begun = store.begin_effect(run.id, claim(owner), "toolu_1", "charge", "key")
        lapse()
        return begun

    def left() -> list[tuple[bool, datetime | None]]:
        return [(r.done, r.started_at) for r in store.effects(run.id).values()]

    first = attempt("a")
    if case == "gone before":
        store.forget_effect(run.id, first)  # it said it failed, before the next began
    if case in ("two back", "three back"):
        second, third = attempt("b"), attempt("c")
        assert (third.taken_over, third.beneath) == (second.started_at, first.started_at)
        if case == "two back":
            store.forget_effect(run.id, second)  # b failed: c hands back to a
            store.forget_effect(run.id, third)
            assert left() == [(False, first.started_at)]
        else:
            epoch = claim("d")  # d reads c's intent; c fails before d begins
            store.forget_effect(run.id, third)
            fourth = store.begin_effect(run.id, epoch, "toolu_1", "charge", "key")
            assert (fourth.taken_over, fourth.beneath) == (second.started_at, first.started_at)
            store.forget_effect(run.id, fourth)  # back to b, which had taken a over
            store.forget_effect(run.id, second)  # b fails: back to a, unknown
            assert left() == [(False, first.started_at)]
        store.close()
        return
    if case == "sent again":
        # begin's first try committed, its reply lost, and it was sent again: the
        # intent it left is its own, not an attempt of unknown outcome to hand back to.
        epoch, now = claim("b"), utcnow()
        for _ in range(2):
            again = store._effects._begin(run.id, epoch, "toolu_1", "charge", "key", now)
        assert (again.taken_over, again.beneath) == (first.started_at, None)
        store.forget_effect(run.id, again)
        assert left() == [(False, first.started_at)]
        store.close()
        return
    again = attempt("b")
    if case == "both failed":
        store.forget_effect(run.id, first)  # the paused first one went on, and failed
    store.forget_effect(run.id, again)
    if case == "handed back":  # the first's outcome is unknown still
        assert again.taken_over == first.started_at
        assert left() == [(False, first.started_at)]
    else:
        assert left() == []  # no attempt whose outcome is unknown
    store.close()


@pytest.mark.parametrize("url", ["db_url", "sqlite_url"])
@pytest.mark.parametrize("holder", ["none", "calling", "calling, late success", "done"])
def test_an_effects_result_from_an_execution_that_lost_the_run_is_kept_if_it_is_the_last(
    request: pytest.FixtureRequest, url: str, holder: str
) -> None:
    # The call happened: its result is recorded (and LeaseLostError raised), unless
    # the run's new holder called again since: that attempt's outcome is the one to
    # keep (the paused one's error was kept over a holder's payment that went through).
    # While that call is under way, a late success is recorded (if the holder's call
    # then says it failed, a retry called a third time), not a late error.
    store = SqlStore(request.getfixturevalue(url))
    run, _ = store.create_run(new_run())
    stale = store.claim(run.id, "paused", utcnow() - timedelta(seconds=1))
    assert stale is not None
    first = store.begin_effect(run.id, stale.epoch, "toolu_1", "charge", "key")
    ref = next(r for r in store.sweep_candidates(utcnow()) if r.id == run.id)
    assert store.requeue(ref) is not None
    holds = store.claim(run.id, "holder", soon())
    assert holds is not None
    if holder != "none":
        again = store.begin_effect(run.id, holds.epoch, "toolu_1", "charge", "key")
        assert not again.done and again.started_at not in (None, first.started_at)
        if holder == "done":
            store.finish_effect(run.id, holds.epoch, again, "the holder's", False)
    late = ("charged", False) if "success" in holder else ("gateway timeout", True)
    with pytest.raises(LeaseLostError) as lost:
        store.finish_effect(run.id, stale.epoch, first, *late)
    kept = holder in ("none", "calling, late success")
    # The worker's log says what became of the result ("lost the claim" alone did not).
    said = "the call's result is recorded" if kept else "its result is not recorded"
    assert f"while its effect call toolu_1 (charge) ran: {said}" in str(lost.value)
    record = store.effects(run.id)["toolu_1"]
    assert (record.done, record.result) == {
        "none": (True, "gateway timeout"),  # the last attempt begun: its outcome
        "calling": (False, None),  # the holder's call is under way: not the paused one's
        "calling, late success": (True, "charged"),  # the call happened
        "done": (True, "the holder's"),
    }[holder]
    if holder == "calling, late success":
        # The holder's outcome, when it comes, is the one kept; but not an error over
        # the success (a gateway's "duplicate key"): the call happened, and the model
        # was told it failed.
        assert not store.finish_effect(run.id, holds.epoch, again, "duplicate key", True)
        record = store.effects(run.id)["toolu_1"]
        assert (record.done, record.result, record.is_error) == (True, "charged", False)
        assert store.finish_effect(run.id, holds.epoch, again, "charged again", False)
        record = store.effects(run.id)["toolu_1"]
        assert (record.done, record.result) == (True, "charged again")
    if holder == "none":
        # The holder, about to call again, begins: it finds the result, and calls not.
        begun = store.begin_effect(run.id, holds.epoch, "toolu_1", "charge", "key")
        assert (begun.done, begun.result, begun.is_error) == (True, "gateway timeout", True)
    with pytest.raises(LeaseLostError):  # and it starts no call
        store.begin_effect(run.id, stale.epoch, "toolu_2", "charge", "key2")
    store.close()


def test_a_loss_counted_while_the_sweep_forgets_stale_counts_is_kept(db_url: str) -> None:
    # The sweep's delete found a count stale (lost at step 3, the run at step 4); a
    # requeue meanwhile counted a loss at step 5, the run's step now. Postgres read
    # the count again, but judged it against the run as the delete first saw it
    # (step 4): the fresh count was deleted.
    store = SqlStore(db_url)
    run, _ = store.create_run(new_run())
    url = db_url.replace("+psycopg", "")
    with psycopg.connect(url, autocommit=True) as conn, psycopg.connect(url) as requeue:
        conn.execute(
            "UPDATE agentruns_runs SET status = 'running', step_count = 4 WHERE id = %s",
            (run.id,),
        )
        conn.execute("INSERT INTO agentruns_crashes VALUES (%s, 3, 2)", (run.id,))
        requeue.execute("SELECT 1 FROM agentruns_crashes WHERE run_id = %s FOR UPDATE", (run.id,))
        sweep = threading.Thread(target=store.forget_losses)
        sweep.start()

        def waiting() -> bool:
            return bool(
                conn.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query LIKE 'DELETE FROM agentruns_crashes%%'"
                ).fetchone()
            )

        wait_for(waiting, "the delete to wait for the row")
        conn.execute("UPDATE agentruns_runs SET step_count = 5 WHERE id = %s", (run.id,))
        requeue.execute(
            "UPDATE agentruns_crashes SET at_step = 5, times = 1 WHERE run_id = %s", (run.id,)
        )
        requeue.commit()
        sweep.join(timeout=10)
        rows = conn.execute(
            "SELECT at_step, times FROM agentruns_crashes WHERE run_id = %s", (run.id,)
        ).fetchall()
    assert rows == [(5, 1)]
    store.close()


def test_the_database_allows_one_running_run_per_concurrency_key(db_url: str) -> None:
    store = SqlStore(db_url)
    older, _ = store.create_run(new_run(key="k"))
    newer, _ = store.create_run(new_run(key="k"))
    assert store.claim(newer.id, "x", soon()) is None  # an older run of the key is queued
    assert store.claim(older.id, "x", soon()) is not None
    assert store.claim(newer.id, "x", soon()) is None  # the key is busy
    # Even a write that skips the claim's checks is stopped by the partial unique index.
    with (
        pytest.raises(psycopg.errors.UniqueViolation),
        psycopg.connect(db_url.replace("+psycopg", "")) as conn,
    ):
        conn.execute("UPDATE agentruns_runs SET status = 'running' WHERE id = %s", (newer.id,))
    assert store.next_queued("k") == newer.id
    store.close()


def test_idempotency_keys_are_unique(db_url: str) -> None:
    store = SqlStore(db_url)
    first, created = store.create_run(new_run(idem="evt-1"))
    again, created_again = store.create_run(new_run(idem="evt-1"))
    assert created and not created_again and again.id == first.id
    store.close()


def test_a_checkpoint_with_the_same_step_index_replaces_the_pointer(db_url: str) -> None:
    store = SqlStore(db_url)
    run, guard = _running(store)
    user = {"role": "user", "content": "hi"}
    call = {"type": "tool_use", "id": "t1", "name": "x", "input": {}}
    store.commit(run, guard, Commit(messages=[user, {"role": "assistant", "content": [call]}]))
    store.commit(run, guard, Commit(checkpoint=(0, "tool_use")))
    first = store.checkpoint(run.id)
    assert first is not None and len(first.messages) == 2
    result = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}],
    }
    store.commit(run, guard, Commit(messages=[result], checkpoint=(0, "tool_use")))
    second = store.checkpoint(run.id)
    assert second is not None and second.step_index == 0 and len(second.messages) == 3
    store.close()


def test_a_write_not_marked_durable_commits_without_waiting_for_the_wal_flush(
    db_url: str,
) -> None:
    # One pooled connection, so the WAL syncs counted are this store's backend's own.
    store = SqlStore(db_url, pool_size=1, max_overflow=0)
    same_backend = store.engine.execution_options(isolation_level="AUTOCOMMIT")

    def wal_syncs() -> int:
        with same_backend.connect() as conn:
            conn.exec_driver_sql("SELECT pg_stat_force_next_flush()")
            return int(conn.exec_driver_sql("SELECT wal_sync FROM pg_stat_wal").scalar_one())

    def synchronous_commit() -> str:
        with same_backend.connect() as conn:
            return str(conn.exec_driver_sql("SHOW synchronous_commit").scalar_one())

    run, guard = _running(store)

    def write(durable: bool) -> None:
        store.commit(run, guard, Commit(steps=[_step()], durable=durable))

    before = wal_syncs()
    for _ in range(20):
        write(durable=True)
    durable_syncs = wal_syncs() - before
    before = wal_syncs()
    for _ in range(20):
        write(durable=False)
    lazy_syncs = wal_syncs() - before

    assert durable_syncs >= 20  # each durable write waited for its own flush
    assert lazy_syncs <= 5  # none of its own (the WAL writer may flush meanwhile)
    assert len(store.steps(run.id)) == 40  # and every write is there
    # The setting lasted for the write's own transaction: the connection is as it was.
    assert synchronous_commit() == "on"
    store.close()


def test_writes_of_one_step_and_message_and_of_any_other_shape_store_alike(
    db_url: str,
) -> None:
    # One step and one message take a statement of their own (append_one.sql).
    store = SqlStore(db_url, pool_size=1, max_overflow=0)
    run, guard = _running(store)
    now = utcnow()
    llm = NewStep(
        kind="llm", name="m", output={"usage": {"input_tokens": 3}}, started_at=now, finished_at=now
    )
    tool = NewStep(
        kind="tool", name="t", input={"q": "é"}, output="ok", started_at=now, finished_at=now
    )
    failed = NewStep(
        kind="tool", name="t", input={}, error={"code": "x"}, started_at=now, finished_at=now
    )
    first = {"role": "user", "content": "start"}
    reply = {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}
    writes = [
        Commit(steps=[llm], messages=[first, reply]),  # many
        Commit(steps=[tool], messages=[{"role": "user", "content": "r1"}]),  # one
        Commit(steps=[llm], messages=[reply]),  # one
        Commit(steps=[tool, failed], messages=[{"role": "user", "content": "r2"}]),  # many
        Commit(steps=[failed]),  # many: no message
    ]
    indexes = []
    for write in writes:
        committed = store.commit(run, guard, write)
        assert committed is not None
        indexes.append([s.index for s in committed.steps])
    assert indexes == [[0], [1], [2], [3, 4], [5]]
    stored = store.steps(run.id)
    assert [(s.kind, s.input, s.output, s.error) for s in stored] == [
        (s.kind, s.input, s.output, s.error) for w in writes for s in w.steps
    ]
    assert store.transcript(run.id).messages == [m for w in writes for m in w.messages]
    pooled = store.engine.raw_connection()
    names = pooled.driver_connection.execute("SELECT name FROM pg_prepared_statements").fetchall()
    pooled.close()
    # Named by their text too: a session that holds a statement of a name (another
    # release's, through a pooler that keeps sessions) holds that very text.
    assert {"agentruns_commit", "agentruns_commit_one"} <= {n.rsplit("_", 1)[0] for (n,) in names}
    from agentruns.store.postgres import Prepared

    assert Prepared("x", "SELECT 1", ()).wire_name != Prepared("x", "SELECT 2", ()).wire_name
    store.close()


def test_the_hot_path_prepares_its_statements_again_after_they_are_dropped(db_url: str) -> None:
    store = SqlStore(db_url, pool_size=1, max_overflow=0)
    run, guard = _running(store)
    store.commit(run, guard, Commit(steps=[_step()]))
    pooled = store.engine.raw_connection()
    pooled.driver_connection.execute("DEALLOCATE ALL")  # e.g. a DISCARD ALL by a proxy
    pooled.close()
    committed = store.commit(
        run, guard, Commit(steps=[_step()], messages=[{"role": "user", "content": "é ✓"}])
    )
    assert committed is not None and [s.index for s in committed.steps] == [1]
    assert len(store.steps(run.id)) == 2
    store.close()


def test_the_hot_path_keeps_its_statements_when_psycopg_deallocates_its_own(
    db_url: str,
) -> None:
    # A transaction of psycopg's auto-prepared queries that rolled back (an effect's
    # fence refusing a write) made psycopg send DEALLOCATE ALL; a statement dropped
    # there then cleared the hot path's whole cache, and one prepared since was
    # "already" prepared: every write of it failed on that connection (a run failed
    # with internal_error), until the pool replaced the connection.
    store = SqlStore(db_url, pool_size=1, max_overflow=0)
    run, guard = _running(store)
    assert store.claim(run.id, "me", utcnow()) is None  # the claim is prepared

    in_transaction = store._atomic  # as an effect's record is written

    def rolled_back() -> None:
        with in_transaction.begin() as conn:
            conn.execute(sa.text("SELECT 1 WHERE 1 = :x"), {"x": 1})
            raise LookupError("refused")

    for _ in range(6):  # psycopg prepares a query it has run five times
        with in_transaction.begin() as conn:
            conn.execute(sa.text("SELECT 1 WHERE 1 = :x"), {"x": 1})
    with pytest.raises(LookupError):
        rolled_back()  # psycopg: DEALLOCATE ALL
    assert store.commit(run, guard, Commit(steps=[_step()], durable=False)) is not None
    assert store.claim(run.id, "me", utcnow()) is None  # dropped: prepared again
    for n in range(2):
        committed = store.commit(run, guard, Commit(steps=[_step()], durable=False))
        assert committed is not None and [s.index for s in committed.steps] == [n + 1]
    store.close()


def test_a_hot_statement_is_refused_on_a_connection_inside_a_transaction(db_url: str) -> None:
    # Inside someone's transaction a write would not be its own, nor committed. (The
    # pool rolls back what it gets back, so this guards against a leak around it.)
    from agentruns.store.postgres import COMMIT, _Session, commit_params

    store = SqlStore(db_url, pool_size=2, max_overflow=0)
    run, guard = _running(store)
    pooled = store.engine.raw_connection()
    pooled.driver_connection.execute("BEGIN")
    params = commit_params(run.id, guard, Commit(steps=[_step()]), utcnow())
    with pytest.raises(RuntimeError, match="idle autocommit connection"):
        _Session.of(pooled).row(COMMIT, params)
    pooled.close()
    assert store.steps(run.id) == []
    store.commit(run, guard, Commit(steps=[_step()]))
    assert len(store.steps(run.id)) == 1
    store.close()


def test_a_held_connection_the_server_ended_is_replaced_before_a_write_is_sent(
    db_url: str,
) -> None:
    # A connection ended while the hot path held it between two writes (a restart,
    # an idle timeout, a terminated backend) failed the next write, which aborted its
    # execution: the run waited for recover() (30 s and more, in a chaos audit for
    # 82 runs of 200). The server says so on the socket before anything is sent.
    store = SqlStore(db_url)
    run, guard = _running(store)  # its claim leaves the connection it used held
    ((held, _, _),) = store.writes.held.idle  # type: ignore[attr-defined]
    backend = held.driver_connection.info.backend_pid
    drop_connections(db_url)
    committed = store.commit(run, guard, Commit(steps=[_step("kept")]))
    assert committed is not None
    assert [s.name for s in store.steps(run.id)] == ["kept"]
    ((held, _, _),) = store.writes.held.idle  # type: ignore[attr-defined]
    assert held.driver_connection.info.backend_pid != backend
    store.close()


def test_after_postgres_dropped_every_connection_no_write_or_read_fails(db_url: str) -> None:
    # A restart, a failover: each pooled connection was dead, and the first statement
    # on each (a write through the pool, a read) failed.
    store = SqlStore(db_url)
    run, guard = _running(store)
    pooled = [store.engine.raw_connection() for _ in range(5)]
    for connection in pooled:
        connection.cursor().execute("SELECT 1")
    for connection in pooled:
        connection.close()  # back to the pool, idle
    drop_connections(db_url)
    for n in range(6):
        assert store.get_run(run.id).id == run.id
        assert store.commit(run, guard, Commit(steps=[_step(f"after {n}")])) is not None
    assert len(store.steps(run.id)) == 6
    store.close()


def test_a_write_while_the_server_is_away_fails_and_the_next_gets_a_new_connection(
    db_url: str,
) -> None:
    # The write fails (its execution aborts, recover() finishes the run), and the one
    # after it, once the server is back, connects again.
    store = SqlStore(db_url)
    run, guard = _running(store)
    with database_away(db_url), pytest.raises(sa.exc.OperationalError):
        store.commit(run, guard, Commit(steps=[_step("lost")]))
    assert not store.writes.held.idle  # type: ignore[attr-defined]
    assert store.commit(run, guard, Commit(steps=[_step("after")])) is not None
    assert [s.name for s in store.steps(run.id)] == ["after"]
    store.close()


def test_a_hot_write_that_cannot_connect_raises_sqlalchemys_operational_error() -> None:
    # What the engine takes for an infrastructure error (the run is recovered later,
    # not failed), as from any other query.
    store = SqlStore(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nowhere")
    with pytest.raises(sa.exc.OperationalError):
        store.writes.claim("r", "x", soon(), utcnow())  # type: ignore[arg-type]
    store.close()


def _checkouts(store: SqlStore) -> list[int]:
    counted = [0]

    def count(*_: object) -> None:
        counted[0] += 1

    sa.event.listen(store.engine, "checkout", count)
    return counted


def test_the_hot_path_holds_its_connection_between_writes_instead_of_a_checkout_each(
    db_url: str,
) -> None:
    store = SqlStore(db_url)
    run, guard = _running(store)
    checkouts = _checkouts(store)
    for _ in range(10):
        store.commit(
            run, guard, Commit(steps=[_step()], messages=[{"role": "user", "content": "x"}])
        )
    assert checkouts == [0]
    pool: sa.QueuePool = store.engine.pool  # type: ignore[assignment]
    assert pool.checkedout() == 1
    store.writes.release()
    assert pool.checkedout() == 0
    store.commit(run, guard, Commit(steps=[_step()]))  # and takes one from the pool again
    assert checkouts == [1]
    assert len(store.steps(run.id)) == 11
    store.close()
    assert pool.checkedout() == 0  # close gives it back before the pool goes


def test_the_hot_path_holds_a_few_connections_and_leaves_the_pool_the_rest(
    db_url: str,
) -> None:
    store = SqlStore(db_url, pool_size=8, pool_timeout=2)
    assert store.writes.held.limit == 2  # type: ignore[attr-defined]
    runs = [_running(store) for _ in range(12)]
    start = threading.Barrier(len(runs))

    def write(run: Run, guard: Guard) -> None:
        start.wait()
        for _ in range(5):
            store.commit(run, guard, Commit(steps=[_step()]))

    threads = [threading.Thread(target=write, args=r) for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool: sa.QueuePool = store.engine.pool  # type: ignore[assignment]
    assert 1 <= pool.checkedout() <= 3  # two held, give or take a race between threads
    assert all(len(store.steps(run.id)) == 5 for run, _ in runs)
    # Everyone else still finds the rest of the pool without waiting for the hot path.
    others = [store.engine.raw_connection() for _ in range(8 - pool.checkedout())]
    for pooled in others:
        pooled.close()
    store.close()


def test_the_hot_path_gives_back_a_connection_held_too_long_or_not_idle(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = SqlStore(db_url)
    held = store.writes.held  # type: ignore[attr-defined]
    pool: sa.QueuePool = store.engine.pool  # type: ignore[assignment]
    pooled, session, since = held.take()
    pooled.driver_connection.execute("BEGIN")
    held.give(pooled, session, since, True)  # inside a transaction: back to the pool (rolled back)
    assert not held.idle and pool.checkedout() == 0
    run, guard = _running(store)
    assert len(held.idle) == 1
    monkeypatch.setattr(type(held), "HOLD_S", 0.0)  # out of the pool past HOLD_S: back
    store.commit(run, guard, Commit(steps=[_step()]))
    assert not held.idle and pool.checkedout() == 0
    store.close()


def test_a_held_connection_left_unused_goes_back_to_the_pool_in_time(db_url: str) -> None:
    store = SqlStore(db_url)
    held = store.writes.held  # type: ignore[attr-defined]
    pool: sa.QueuePool = store.engine.pool  # type: ignore[assignment]
    taken = [held.take() for _ in range(3)]  # three writes at once, say
    for pooled, session, since in taken:
        held.give(pooled, session, since, True)
    assert len(held.idle) == 3 and pool.checkedout() == 3
    # The two oldest have been out of the pool past HOLD_S; the newest serves on.
    (a, sa_, t), (b, sb, _), newest = list(held.idle)
    held.idle.clear()
    held.idle.extend([(a, sa_, t - held.HOLD_S), (b, sb, t - held.HOLD_S), newest])
    run, guard = _running(store)
    store.commit(run, guard, Commit(steps=[_step()]))
    assert list(held.idle) == [newest]
    assert pool.checkedout() == 1
    store.close()


def test_a_store_speaks_utf8_whatever_the_client_encoding(db_url: str) -> None:
    store = SqlStore(db_url, connect_args={"options": "-c client_encoding=LATIN1"})
    run, guard = _running(store)
    body = {"role": "user", "content": "naïve ✓ 漢字"}
    store.commit(run, guard, Commit(steps=[_step("✓")], messages=[body]))
    # Read back on connections other than the one the write used (the hot path holds it).
    assert store.writes.held.idle  # type: ignore[attr-defined]
    assert store.transcript(run.id).messages == [body]
    assert [s.name for s in store.steps(run.id)] == ["✓"]
    pooled = store.engine.raw_connection()
    assert pooled.driver_connection.info.encoding == "utf-8"
    assert pooled.driver_connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    pooled.close()
    store.close()


def test_a_store_reads_its_times_whatever_the_date_style_and_time_zone(db_url: str) -> None:
    # A role's or database's DateStyle other than ISO made psycopg refuse every
    # timestamp it read (after a dispatch had stored its run); a TimeZone other
    # than UTC printed times with the server's offset.
    options = "-c datestyle=SQL,DMY -c timezone=Asia/Kathmandu"
    store = SqlStore(db_url, connect_args={"options": options})
    before = utcnow()
    run, guard = _running(store)  # created, then claimed through the hot path
    store.commit(run, guard, Commit(steps=[_step()], messages=[{"role": "user", "content": "x"}]))
    for read in (store.get_run(run.id), *store.list_runs()):
        for at in (read.created_at, read.updated_at, read.claim.expires_at):  # type: ignore[union-attr]
            assert at.utcoffset() == timedelta(0)
            assert before - timedelta(seconds=1) < at < utcnow() + timedelta(minutes=5)
    assert [s.started_at.utcoffset() for s in store.steps(run.id)] == [timedelta(0)]
    store.close()


def test_a_session_idle_in_its_transaction_is_ended_by_the_server(db_url: str) -> None:
    # A worker cut off in the middle of a transaction left its backend holding the
    # run's row for as long as the server's keepalives took (hours): sweeps waited.
    store = SqlStore(db_url, pool_size=1, max_overflow=0)
    with store.engine.connect() as conn:
        said = conn.exec_driver_sql("SHOW idle_in_transaction_session_timeout").scalar()
    assert said == "1min"
    store.close()
    # A limit of the role's or database's own (here, the connection's) stands.
    store = SqlStore(db_url, connect_args={"options": "-c idle_in_transaction_session_timeout=5s"})
    with store.engine.connect() as conn:
        said = conn.exec_driver_sql("SHOW idle_in_transaction_session_timeout").scalar()
    assert said == "5s"
    store.close()


def test_a_connection_comes_back_from_a_transaction_block_idle_and_autocommit(
    db_url: str,
) -> None:
    # The hot path needs idle autocommit connections: the blocks that open a
    # transaction leave none behind, even when they fail.
    store = SqlStore(db_url, pool_size=1, max_overflow=0)
    with pytest.raises(ZeroDivisionError), store._atomic.begin() as conn:
        conn.exec_driver_sql("SELECT 1")
        assert not conn.connection.driver_connection.autocommit
        _ = 1 / 0
    pooled = store.engine.raw_connection()
    driver = pooled.driver_connection
    assert driver.autocommit
    assert driver.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    pooled.close()
    store.close()


def test_a_connection_returned_inside_a_transaction_is_rolled_back(db_url: str) -> None:
    store = SqlStore(db_url, pool_size=1, max_overflow=0)
    run, guard = _running(store)
    pooled = store.engine.raw_connection()
    driver = pooled.driver_connection
    driver.execute("BEGIN")
    driver.execute("UPDATE agentruns_runs SET output = 'leaked' WHERE id = %s", (run.id,))
    pooled.close()  # e.g. code that forgot to commit or roll back
    pooled = store.engine.raw_connection()
    assert pooled.driver_connection is driver  # the same connection, idle again
    assert driver.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    pooled.close()
    assert store.get_run(run.id).output is None
    store.commit(run, guard, Commit(steps=[_step()]))  # and the hot path can use it
    store.close()


def test_a_hot_statement_refuses_a_parameter_it_has_no_text_form_for() -> None:
    from agentruns.store.postgres import CLAIM

    with pytest.raises(TypeError, match="no text form for a parameter of type dict"):
        CLAIM.values({"run_id": {"not": "text"}, "owner": "x", "expires_at": None, "now": None})


@pytest.mark.parametrize("statement", ["commit", "commit_one", "claim"])
def test_the_hot_statements_find_their_run_by_id_in_a_generic_plan(
    db_url: str, statement: str
) -> None:
    # The store prepares these statements; their generic plan must not pick the
    # status index (which would filter every running or queued run per write).
    from psycopg import sql

    from agentruns.store.postgres import CLAIM, COMMIT, COMMIT_ONE, commit_params

    store = SqlStore(db_url)
    run, _ = store.create_run(new_run())
    if statement.startswith("commit"):
        one = statement == "commit_one"
        write = (
            Commit(steps=[_step()], messages=[{"role": "user", "content": "x"}])
            if one
            else Commit()
        )
        hot, params = (
            COMMIT_ONE if one else COMMIT,
            commit_params(run.id, Guard(RunStatus.RUNNING, 1), write, utcnow()),
        )
    else:
        hot = CLAIM
        params = {"run_id": run.id, "owner": "x", "expires_at": soon(), "now": utcnow()}
    with psycopg.connect(db_url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(sql.SQL("PREPARE hot AS {}").format(sql.SQL(hot.text)))
        args = sql.SQL(", ").join(sql.Literal(params[n]) for n in hot.params)
        explain = sql.SQL("EXPLAIN EXECUTE hot({})").format(args)
        plan = "\n".join(row[0] for row in conn.execute(explain))
    assert "agentruns_runs_id_key" in plan, plan
    assert "agentruns_runs_status" not in plan, plan
    if hot is CLAIM:  # runs held by a waiting run of their thread: by the thread's index
        assert "agentruns_runs_thread" in plan, plan
    store.close()


def _seed_finished(url: str, key: str | None, count: int) -> None:
    """``count`` completed runs of ``key``, a day old and older, and fresh statistics."""
    with psycopg.connect(url.replace("+psycopg", "", 1), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO agentruns_runs (id, agent, status, trigger, concurrency_key,"
            " created_at, updated_at, finished_at)"
            " SELECT %(prefix)s || g, 'a', 'completed', '{}', %(key)s,"
            " now() - interval '1 day' - g * interval '1 s', now(), now()"
            " FROM generate_series(1, %(count)s) AS g",
            {"prefix": f"{key}-done-", "key": key, "count": count},
        )
        conn.execute("ANALYZE agentruns_runs")


def _sent(store: SqlStore, call: Callable[[], object]) -> tuple[str, list[object]]:
    """The last statement ``call`` made the store send, with ``$n`` parameters."""
    sent: list[tuple[str, dict[str, object]]] = []

    def seen(conn: object, cursor: object, statement: str, params: object, *_: object) -> None:
        assert isinstance(params, dict)
        sent.append((statement, params))

    sa.event.listen(store.engine, "before_cursor_execute", seen)
    try:
        call()
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", seen)
    statement, params = sent[-1]
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    return re.sub(r"%\((\w+)\)s", number, statement), [params[n] for n in names]


def _plan(
    url: str, statement: str, params: list[object], generic: bool = True
) -> list[dict[str, object]]:
    """The nodes of the plan a prepared ``statement`` gets: generic by default (one
    plan for any parameters: the planner sees none of their values), else custom."""
    from psycopg import sql

    with psycopg.connect(url.replace("+psycopg", "", 1), autocommit=True) as conn:
        mode = "force_generic_plan" if generic else "force_custom_plan"
        conn.execute(sql.SQL("SET plan_cache_mode = {}").format(sql.SQL(mode)))
        conn.execute(sql.SQL("PREPARE stmt AS {}").format(sql.SQL(statement)))
        args = sql.SQL(", ").join(sql.Literal(p) for p in params)
        explain = sql.SQL("EXPLAIN (FORMAT JSON) EXECUTE stmt{}").format(
            sql.SQL("({})").format(args) if params else sql.SQL("")
        )
        row = conn.execute(explain).fetchone()
    assert row is not None
    nodes: list[dict[str, object]] = []

    def walk(node: dict[str, object]) -> None:
        nodes.append(node)
        for child in node.get("Plans", []):  # type: ignore[attr-defined]
            walk(child)

    walk(row[0][0]["Plan"])
    return nodes


def _plan_nodes(node: dict[str, object]) -> list[dict[str, object]]:
    """A plan node and every node under it."""
    below = node.get("Plans", [])
    assert isinstance(below, list)
    return [node, *(n for child in below for n in _plan_nodes(child))]


def _scans(nodes: list[dict[str, object]]) -> set[str]:
    """The indexes a plan scans, and ``Seq Scan`` if it reads a table of runs in full."""
    found = {str(n["Index Name"]) for n in nodes if "Index Name" in n}
    found |= {
        "Seq Scan"
        for n in nodes
        if n["Node Type"] == "Seq Scan" and n.get("Relation Name") == "agentruns_runs"
    }
    return found


@pytest.mark.parametrize("statement", ["claim", "claimable", "next_queued", "sweep_candidates"])
def test_a_keys_line_is_read_without_the_runs_it_finished(db_url: str, statement: str) -> None:
    # A chat thread's runs share its key: with 200k finished ones, a claim took
    # 41 ms and a sweep 5 s, walking the key's index through all of them.
    from agentruns.store.postgres import CLAIM

    store = SqlStore(db_url)
    line = [store.create_run(new_run(key="thread:chat"))[0] for _ in range(3)]
    _seed_finished(db_url, "thread:chat", 20_000)
    _seed_finished(db_url, None, 20_000)
    if statement == "claim":
        values = {"run_id": line[1].id, "owner": "x", "expires_at": soon(), "now": utcnow()}
        text_and_params = (CLAIM.text, [values[name] for name in CLAIM.params])
    else:
        call = {
            "claimable": lambda: store.claimable(line[1].id),
            "next_queued": lambda: store.next_queued("thread:chat"),
            "sweep_candidates": lambda: store.sweep_candidates(utcnow()),
        }[statement]
        text_and_params = _sent(store, call)
    scans = _scans(_plan(db_url, *text_and_params))
    assert "agentruns_runs_key_line" in scans and "Seq Scan" not in scans, scans
    assert "agentruns_runs_key_created" not in scans, scans
    store.close()


def test_a_threads_waiting_runs_are_looked_up_by_the_threads_index(db_url: str) -> None:
    # Whether a run waiting on an approval holds its thread's next run: the lookup
    # went through the key's index too, over the thread's whole history (20 ms at
    # 200k finished runs, in the claim), or through the status index, over every
    # run waiting anywhere.
    from dataclasses import replace

    from agentruns.store.postgres import CLAIM

    store = SqlStore(db_url)
    line = [
        store.create_run(replace(new_run(key="thread:chat"), thread="chat"))[0] for _ in range(2)
    ]
    with psycopg.connect(db_url.replace("+psycopg", "", 1), autocommit=True) as conn:
        seeds = (("completed", "'chat'", 200_000), ("waiting", "'t' || g", 50_000))
        for status, thread, count in seeds:
            conn.execute(
                "INSERT INTO agentruns_runs (id, agent, status, trigger, concurrency_key, thread,"
                " created_at, updated_at, finished_at)"
                f" SELECT %(status)s || g, 'a', %(status)s, '{{}}', 'thread:' || {thread},"
                f" {thread},"
                " now() - interval '1 day' - g * interval '1 s', now(),"
                " CASE WHEN %(status)s = 'completed' THEN now() END"
                " FROM generate_series(1, %(count)s) AS g",
                {"status": status, "count": count},
            )
        conn.execute("ANALYZE agentruns_runs")
    values = {"run_id": line[1].id, "owner": "x", "expires_at": soon(), "now": utcnow()}
    for text_and_params in (
        (CLAIM.text, [values[name] for name in CLAIM.params]),
        _sent(store, lambda: store.claimable(line[1].id)),
        _sent(store, lambda: store.sweep_candidates(utcnow())),
    ):
        nodes = _plan(db_url, *text_and_params)
        held = [n for n in nodes if n.get("Alias") == "held"]  # (a bitmap's indexes under it)
        indexes = {str(i["Index Name"]) for n in held for i in _plan_nodes(n) if "Index Name" in i}
        assert held and indexes == {"agentruns_runs_thread"}, (text_and_params[0], held)
    store.close()


@pytest.mark.parametrize(
    ("listing", "index"),
    [
        ({}, "agentruns_runs_created"),
        ({"status": RunStatus.QUEUED}, "agentruns_runs_status_created"),
        ({"status": RunStatus.QUEUED, "agent": "a"}, "agentruns_runs_status_created"),
        ({"agent": "rare"}, "agentruns_runs_agent_created"),
    ],
)
def test_runs_are_listed_newest_first_through_an_index(
    db_url: str, listing: dict[str, object], index: str
) -> None:
    # `agentruns runs` read the whole table and sorted it: 86 ms at 231k runs.
    store = SqlStore(db_url)
    queued = [store.create_run(new_run())[0] for _ in range(3)]
    _seed_finished(db_url, None, 20_000)
    statement, params = _sent(store, lambda: store.list_runs(**listing))  # type: ignore[arg-type]
    # An agent is a parameter: only a custom plan (the first few of a connection,
    # and every one of `agentruns runs`) sees which, and how rare it is.
    scans = _scans(_plan(db_url, statement, params, generic="agent" not in listing))
    assert index in scans and "Seq Scan" not in scans, scans
    if listing == {"status": RunStatus.QUEUED}:
        assert store.list_runs(**listing) == list(reversed(queued))  # type: ignore[arg-type]
    store.close()


@pytest.mark.parametrize("read", ["waiting_runs", "sweep_candidates"])
def test_the_runs_of_a_status_are_read_through_its_index_in_a_generic_plan(
    db_url: str, read: str
) -> None:
    # With its status as a parameter, tick's read of the waiting runs went through
    # the whole table in the primary key's order.
    store = SqlStore(db_url)
    store.create_run(new_run())
    _seed_finished(db_url, None, 20_000)
    call = {
        "waiting_runs": store.waiting_runs,
        "sweep_candidates": lambda: store.sweep_candidates(utcnow()),
    }[read]
    scans = _scans(_plan(db_url, *_sent(store, call)))
    assert "agentruns_runs_status_created" in scans and "Seq Scan" not in scans, scans
    assert "agentruns_runs_pkey" not in scans, scans
    store.close()


def test_a_store_keeps_the_connections_it_opens_up_to_its_pool_size(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentruns.wiring import engine_from_settings

    # A burst opens connections once; none is closed after it (no overflow churn).
    store = SqlStore(db_url)
    assert store.engine.pool.size() == 30  # type: ignore[attr-defined]
    conns = [store.engine.raw_connection() for _ in range(12)]
    for conn in conns:
        conn.close()
    assert store.engine.pool.checkedin() == 12  # type: ignore[attr-defined]
    store.close()

    monkeypatch.setenv("AGENTRUNS_DATABASE_POOL_SIZE", "7")
    monkeypatch.delenv("AGENTRUNS_REDIS_URL", raising=False)
    settings = Settings(database_url=db_url, agents="workers.triage", secret="s")
    engine = engine_from_settings(settings)
    assert engine.store.engine.pool.size() == 7  # type: ignore[attr-defined]
    engine.close()


def test_sqlite_reads_go_on_while_another_process_writes(sqlite_url: str) -> None:
    # WAL mode lets a read see its snapshot during a write; a read must not queue
    # for the write lock as writes do (`agentruns runs` or `watch` during a run).
    import sqlite3

    store = SqlStore(sqlite_url)
    run, guard = _running(store)
    writer = sqlite3.connect(sa.make_url(sqlite_url).database or "", isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # holds the write lock, as a long write would
    try:
        read: list[object] = []
        reader = threading.Thread(
            target=lambda: read.extend([store.get_run(run.id), store.steps(run.id)]), daemon=True
        )
        reader.start()
        reader.join(timeout=5)  # the busy timeout is 30 s: a queued read would still wait
        assert read and read[0] == store.get_run(run.id), "a read waited for the write lock"
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    # Writes still take the lock first, and so queue behind each other.
    assert store.commit(run, guard, Commit(steps=[_step("after")])) is not None
    store.close()


def test_a_claim_as_an_older_run_of_its_key_is_interrupted_does_not_overtake_it(
    db_url: str,
) -> None:
    # The older run is drained (running -> interrupted) in a transaction still open
    # as the newer one is claimed: the newer one must stay queued behind it.
    store = SqlStore(db_url)
    older, _ = store.create_run(new_run(key="k"))
    newer, _ = store.create_run(new_run(key="k"))
    assert store.claim(older.id, "x", soon()) is not None
    plain = db_url.replace("+psycopg", "")
    claimed: list[object] = []
    with psycopg.connect(plain) as draining, psycopg.connect(plain, autocommit=True) as look:
        draining.execute(
            "UPDATE agentruns_runs SET status = 'interrupted', claim_owner = NULL WHERE id = %s",
            (older.id,),
        )
        claim = threading.Thread(target=lambda: claimed.append(store.claim(newer.id, "y", soon())))
        claim.start()
        # The claim either returns at once or waits for the draining transaction.
        wait_for(
            lambda: (
                claimed
                or look.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock'"
                ).fetchone()
            ),
            "the claim to return or wait",
        )
        draining.commit()
        claim.join(timeout=10)
    assert claimed == [None]
    assert store.get_run(newer.id).status is RunStatus.QUEUED
    store.close()


def test_a_cancel_as_the_run_pauses_still_cancels_it(db_url: str) -> None:
    # The run pauses (running -> waiting) in a transaction that holds its row while
    # cancel() updates it: the cancel waits, then decides by the status it finds,
    # and cancels the now waiting run (flagging it as still running would leave it
    # waiting, answerable, with cancel_requested set).
    store = SqlStore(db_url)
    run, _ = _running(store)
    plain = db_url.replace("+psycopg", "")
    done: list[Run] = []
    with psycopg.connect(plain) as pausing, psycopg.connect(plain, autocommit=True) as look:
        pausing.execute("UPDATE agentruns_runs SET status = 'waiting' WHERE id = %s", (run.id,))
        cancel = threading.Thread(target=lambda: done.append(store.request_cancel(run.id)))
        cancel.start()
        wait_for(
            lambda: look.execute(
                "SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock'"
                " AND query LIKE 'UPDATE agentruns_runs%%'"
            ).fetchone(),
            "the cancel to wait for the pausing transaction",
        )
        assert not done
        pausing.commit()
        cancel.join(timeout=10)
    assert done and done[0].status is RunStatus.CANCELLED
    assert store.get_run(run.id).status is RunStatus.CANCELLED
    store.close()


def test_a_database_agentruns_cannot_use_is_refused_in_one_clear_error() -> None:
    for url in ("mysql://root@127.0.0.1/test", "postgresql+psycopg2://postgres@127.0.0.1/test"):
        with pytest.raises(AgentrunsError, match=r"Postgres .* or SQLite"):
            SqlStore(url)


def test_a_closed_store_leaves_nothing_alive(db_url: str) -> None:
    # The held connections' error listener sat on the engine's dialect, which
    # SQLAlchemy's caches keep: every closed store stayed in memory (up to 128).
    stores = [SqlStore(db_url) for _ in range(3)]
    alive = [weakref.ref(store.engine) for store in stores]
    for store in stores:
        _running(store)  # its writes held a connection
        store.check_schema()  # SQLAlchemy's caches meet its dialect here
        store.close()
    del stores, store
    gc.collect()
    assert [ref() for ref in alive] == [None, None, None]


def test_a_forked_child_leaves_its_parents_connections_alone(db_url: str) -> None:
    # The child used the parent's pooled and held connections, and closing its
    # store closed them: the parent's next statement failed.
    store = SqlStore(db_url)
    run, _ = _running(store)  # the hot path holds a connection
    store.list_runs()  # the pool has one too
    held = store.writes.held.idle  # type: ignore[attr-defined]
    parents = {pooled.driver_connection.info.backend_pid for pooled, _, _ in held}
    assert parents
    pid = os.fork()
    if pid == 0:  # the child: its own connections, then closed
        code = 1
        try:
            ok = store.get_run(run.id).id == run.id
            _running(store)  # written on a connection of its own, then held
            mine = {pooled.driver_connection.info.backend_pid for pooled, _, _ in held}
            code = 0 if ok and mine and not mine & parents else 1
            store.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.get_run(run.id).status is RunStatus.RUNNING
    _running(store)  # a write on the held connection
    store.close()


def test_a_failed_statement_shows_no_parameters(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A statement that failed (an outage) showed its parameters in its error, the
    # start of a trigger's payload among them; errors reach logs, on_error and
    # Celery's task events (Flower). Through SQLAlchemy and through the hot path.
    from dataclasses import replace

    from agentruns.store import postgres

    store = SqlStore(db_url)
    with pytest.raises(sa.exc.DBAPIError) as failed, store.engine.connect() as conn:
        conn.execute(sa.text("SELECT CAST(:secret AS text), 1 / 0"), {"secret": "PAYLOADMARK"})
    assert "PAYLOADMARK" not in str(failed.value)

    def broken(self: object, statement: object, params: object) -> None:
        raise psycopg.OperationalError("the server closed the connection")

    monkeypatch.setattr(postgres._Session, "row", broken)
    secret = TriggerEnvelope(source="m", trigger="m", payload={"ssn": "PAYLOADMARK"})
    with pytest.raises(sa.exc.OperationalError) as failed_write:
        store.create_run(replace(new_run(), trigger=secret))
    assert "PAYLOADMARK" not in str(failed_write.value)
    store.close()


def test_a_sqlite_run_created_while_another_holds_the_write_lock_is_timed_at_its_write(
    sqlite_url: str,
) -> None:
    # Its creation time was taken before the wait for SQLite's write lock: a run stored
    # after another could read as created before it, and a thread's line, which goes
    # by creation time, ran them out of order (a retry could then fork the thread).
    store = SqlStore(sqlite_url)
    path = sa.make_url(sqlite_url).database or ""
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    released: list[datetime] = []

    def release() -> None:
        time.sleep(0.6)
        released.append(utcnow())
        holder.execute("COMMIT")

    releaser = threading.Thread(target=release)
    releaser.start()
    run, created = store.create_run(new_run())
    releaser.join()
    holder.close()
    assert created and run.created_at >= released[0]
    claimed = store.claim(run.id, "me", soon())
    assert claimed is not None and claimed.run.started_at is not None
    store.close()
