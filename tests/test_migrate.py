"""Migrations: ``agentruns migrate``, the schema check an engine makes, and upgrades
from what each earlier schema left (a rolling deploy's old workers beside new ones)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa

from agentruns import Agent, Engine, RunStatus, SqlStore
from agentruns.errors import AgentrunsError, NotMigratedError, RunNotFoundError
from agentruns.migrate import migrate
from agentruns.migrations import (
    FLOOR,
    FLOOR_TABLE,
    HEAD,
    LEGACY_VERSION_TABLE,
    REVISIONS,
    VERSION_TABLE,
    current_revision,
    schema_floor,
)
from agentruns.models import ScriptedModel, text
from agentruns.runs import utcnow
from agentruns.settings import Settings
from tests.conftest import PG_ADMIN
from tests.support.rows import new_run, soon


def upgrade_to(conn: sa.Connection, revision: str) -> None:
    """The database brought to ``revision`` only, as an older release's migrate left it
    (its revision in Alembic's default table)."""
    from alembic import command

    from agentruns.migrate import _config

    config = _config()
    config.attributes["connection"] = conn
    config.attributes["version_table"] = LEGACY_VERSION_TABLE
    command.upgrade(config, revision)


def left_by_an_earlier_release(url: str, revision: str) -> None:
    """The database at ``url`` brought to ``revision`` by an earlier release's migrate."""
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            upgrade_to(conn, revision)
    finally:
        engine.dispose()


def test_an_engine_refuses_an_unmigrated_database_naming_agentruns_migrate(
    empty_pg: str, tmp_path: object
) -> None:
    agent = Agent("a", ScriptedModel([text("ok")]))
    for url in (empty_pg, f"sqlite:///{tmp_path}/fresh.db"):
        with pytest.raises(NotMigratedError, match="agentruns migrate"):
            Engine(SqlStore(url), agents=[agent], secret="s")
        store = SqlStore(url)
        assert store.migrate() == migrate(url)  # idempotent
        Engine(store, agents=[agent], secret="s").close()


def test_an_engine_on_a_sqlite_file_that_does_not_exist_leaves_none_behind(
    tmp_path: Path,
) -> None:
    # Engine("sqlite:///typo.db") created an empty typo.db before refusing it, and
    # `agentruns migrate` would then take it for the database meant.
    path = tmp_path / "typo.db"
    with pytest.raises(NotMigratedError, match="does not exist: run `agentruns migrate`"):
        Engine(f"sqlite:///{path}", secret="s")
    assert not path.exists()
    memory = SqlStore("sqlite://")  # no file to look for: SQLite's own
    with pytest.raises(NotMigratedError, match="not migrated"):
        memory.check_schema()
    memory.close()


def test_a_store_used_bare_on_a_sqlite_file_that_does_not_exist_leaves_none_behind(
    tmp_path: Path,
) -> None:
    # SqlStore(url) used without an engine (its schema not checked) created the empty
    # file at its first statement, and said "no such table: agentruns_runs".
    path = tmp_path / "typo.db"
    store = SqlStore(f"sqlite:///{path}")
    for use in (lambda: store.get_run("x"), lambda: store.list_runs()):
        with pytest.raises(NotMigratedError, match="does not exist: run `agentruns migrate`"):
            use()
    assert not path.exists()
    store.migrate()  # which creates it
    with pytest.raises(RunNotFoundError):
        store.get_run("x")
    store.close()


def test_an_engine_refused_by_the_schema_leaves_no_connection_open(
    empty_pg: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker on a database not migrated yet builds an engine for each message it
    # gives back: each refused one left a connection open, and Postgres ran out of
    # them (100 in about 30 s), `agentruns migrate` too.
    from agentruns.wiring import engine_from_settings

    monkeypatch.setenv("AGENTRUNS_DATABASE_URL", empty_pg)
    monkeypatch.setenv("AGENTRUNS_AGENTS", "workers.triage")
    for var in ("AGENTRUNS_REDIS_URL", "AGENTRUNS_BROKER_URL"):
        monkeypatch.delenv(var, raising=False)
    for _ in range(10):
        with pytest.raises(NotMigratedError):
            Engine(empty_pg, secret="s")
        with pytest.raises(NotMigratedError):
            engine_from_settings(Settings())
    name = sa.make_url(empty_pg).database
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        count = admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (name,)
        ).fetchone()
    assert count is not None and count[0] == 0


def test_an_engine_on_a_database_a_newer_release_migrated_says_so(tmp_path: object) -> None:
    # It said "not migrated (at 0003, need 0002): run `agentruns migrate`", which
    # this release's migrate cannot do: it knows no way back from there.
    url = f"sqlite:///{tmp_path}/newer.db"
    migrate(url)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {VERSION_TABLE} SET version_num = '9999'"))
        # Its migrations broke the statements of the releases before it.
        conn.execute(sa.text(f"UPDATE {FLOOR_TABLE} SET revision = '9999'"))
    engine.dispose()
    with pytest.raises(NotMigratedError, match="at schema 9999, newer than this release"):
        SqlStore(url).check_schema()
    # And `agentruns migrate` there (a deploy rolled back): it said "unexpected
    # CommandError: Can't locate revision identified by '9999'".
    with pytest.raises(AgentrunsError, match="at schema 9999, newer than this release"):
        migrate(url)


def test_the_migrations_leave_the_floor_this_release_declares(
    empty_pg: str, tmp_path: object
) -> None:
    for url in (empty_pg, f"sqlite:///{tmp_path}/floor.db"):
        migrate(url)
        engine = sa.create_engine(url)
        with engine.connect() as conn:
            assert schema_floor(conn) == FLOOR
        engine.dispose()


def test_an_engine_works_on_a_database_a_newer_release_migrated_if_it_says_it_may(
    empty_pg: str, tmp_path: object, caplog: pytest.LogCaptureFixture
) -> None:
    # A prefork child of an older release that started once the new release's migrate
    # had run (never used before, or recycled by max_tasks_per_child) refused the
    # database, though the migration had only added a table: it gave every message
    # back until the workers were replaced.
    for url in (empty_pg, f"sqlite:///{tmp_path}/newer.db"):
        migrate(url)
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.execute(sa.text(f"UPDATE {VERSION_TABLE} SET version_num = '9999'"))
        engine.dispose()  # the floor stays: 0005 left the release before it working
        assert migrate(url) == "9999"  # nothing to do (a deploy rolled back)
        with caplog.at_level("INFO", logger="agentruns"):
            agentruns = Engine(url, agents=[Agent("a", ScriptedModel([text("ok")]))], secret="s")
        try:
            run = agentruns.dispatch("a", {"source": "s", "trigger": "t"})
            assert agentruns.idle(10)
            assert agentruns.get_run(run.id).output == "ok"
        finally:
            agentruns.close()
        said = f"at schema 9999, newer than this release of agentruns knows ({HEAD}); it works"
        assert f"{said} with releases from schema 0004 on" in caplog.text


def test_the_revisions_an_engine_checks_for_are_alembics_own() -> None:
    # An engine checks the revision without Alembic: a new migration must be
    # named in REVISIONS too, or every engine would refuse the migrated database.
    from alembic.script import ScriptDirectory

    from agentruns.migrate import _config

    history = ScriptDirectory.from_config(_config()).walk_revisions()
    assert tuple(reversed([script.revision for script in history])) == REVISIONS


def test_an_engine_starts_without_importing_alembic(pg_url: str) -> None:
    # Importing it cost every worker process about 0.25 s, and logged nine INFO
    # lines ("setup plugin alembic.autogenerate...", "Context impl ...").
    code = (
        "import sys\n"
        "from agentruns import Engine, SqlStore\n"
        "Engine(SqlStore(sys.argv[1]), agents=[], secret='s').close()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'alembic'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, pg_url], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_migrations_run_at_once_by_several_deploys_all_succeed(empty_pg: str) -> None:
    # Each process upgrades from nothing at the same moment: without a lock, all
    # but one failed creating the same tables (or adding the same columns).
    code = "import sys; from agentruns.migrate import migrate; migrate(sys.argv[1])"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, empty_pg],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [(p.wait(timeout=60), p.stdout.read() if p.stdout else "") for p in procs]
    assert [rc for rc, _ in outputs] == [0, 0, 0], outputs
    assert migrate(empty_pg) == HEAD


def test_the_migrations_build_the_schema_the_store_uses(empty_pg: str, tmp_path: object) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from agentruns.store import schema

    for url in (empty_pg, f"sqlite:///{tmp_path}/fresh.db"):
        migrate(url)
        engine = sa.create_engine(url)
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
            diff = compare_metadata(context, schema.metadata)
        engine.dispose()
        assert diff == [], url


def test_a_migration_a_long_transaction_holds_up_gives_up_changing_nothing(
    empty_pg: str,
) -> None:
    # It waited as long as the transaction lasted, and every write to the table
    # queued behind it: a report query could stop a whole fleet.
    left_by_an_earlier_release(empty_pg, "0001")
    engine = sa.create_engine(empty_pg)
    with engine.connect() as reader:
        reader.execute(sa.text("SELECT count(*) FROM agentruns_runs"))  # holds its lock
        started = time.monotonic()
        with pytest.raises(AgentrunsError, match=r"waited 0\.5 s for a table lock"):
            migrate(empty_pg, lock_timeout=0.5)
        assert time.monotonic() - started < 5
        reader.rollback()
    with engine.connect() as conn:
        assert current_revision(conn) == "0001"  # nothing changed
    engine.dispose()
    assert migrate(empty_pg) == HEAD


def test_a_migration_that_waits_on_the_revisions_table_gives_up_saying_so(
    empty_pg: str,
) -> None:
    # Its read of the revision waited on a lock of that table and said "database error
    # on …: canceling statement due to lock timeout".
    migrate(empty_pg)
    engine = sa.create_engine(empty_pg)
    with engine.connect() as holder:
        holder.execute(sa.text(f"LOCK TABLE {VERSION_TABLE} IN ACCESS EXCLUSIVE MODE"))
        with pytest.raises(AgentrunsError, match=r"waited 0\.5 s for a table lock"):
            migrate(empty_pg, lock_timeout=0.5)
        holder.rollback()
    with engine.connect() as conn:
        assert current_revision(conn) == HEAD
    engine.dispose()


def test_a_thread_stored_before_0002_is_continued_after_it(empty_pg: str, tmp_path: object) -> None:
    # A thread's run stored by 0001's code holds its history as its own messages;
    # after the migration, the thread's next run continues from them.
    for url in (empty_pg, f"sqlite:///{tmp_path}/old.db"):
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            upgrade_to(conn, "0001")
            conn.execute(
                sa.text(
                    "INSERT INTO agentruns_runs (id, agent, status, trigger, thread,"
                    " concurrency_key, message_count, step_count, steps_used,"
                    " checkpoint_step, checkpoint_messages, output, created_at, updated_at,"
                    " finished_at) VALUES ('old', 'a', 'completed', '{}', 'chat', 'thread:chat',"
                    " 2, 1, 1, 0, 2, 'hello', :now, :now, :now)"
                ),
                {"now": utcnow()},
            )
            key = conn.execute(sa.text("SELECT key FROM agentruns_runs")).scalar_one()
            bodies = [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
            ]
            for seq, body in enumerate(bodies):
                conn.execute(
                    sa.insert(
                        sa.table(
                            "agentruns_messages",
                            sa.column("run_key"),
                            sa.column("seq"),
                            sa.column("body", sa.JSON),
                        )
                    ),
                    {"run_key": key, "seq": seq, "body": body},
                )
            # A run waiting then keeps its token id, which a resume's guard now reads.
            conn.execute(
                sa.text(
                    "INSERT INTO agentruns_runs (id, agent, status, trigger, waiting,"
                    " created_at, updated_at) VALUES ('waits', 'a', 'waiting', '{}',"
                    " :waiting, :now, :now)"
                ),
                {"now": utcnow(), "waiting": json.dumps({"token_id": "t1", "input": "\x00"})},
            )
        engine.dispose()
        migrate(url)
        engine = sa.create_engine(url)
        with engine.connect() as conn:
            tokens = conn.execute(sa.text("SELECT id, waiting_token FROM agentruns_runs"))
            assert dict(tokens.all()) == {"old": None, "waits": "t1"}
        engine.dispose()
        model = ScriptedModel(lambda messages: text(f"answer {len(messages)}"))
        agentruns = Engine(SqlStore(url), agents=[Agent("a", model)], secret="s")
        try:
            run = agentruns.dispatch("a", {"source": "s", "trigger": "t"}, thread="chat")
            assert agentruns.idle(10)
            assert agentruns.get_run(run.id).output == "answer 3"
            assert model.calls[0][:2] == bodies
            checkpoint = agentruns.checkpoint(run.id)
            assert checkpoint is not None and checkpoint.messages[:2] == bodies
        finally:
            agentruns.close()


def test_migrations_after_the_first_add_no_column_a_running_release_would_not_expect(
    empty_pg: str,
) -> None:
    # 0003 once added two columns: a worker of 0002 still running (a rolling deploy)
    # had prepared its claim with RETURNING r.*, and every claim of it then failed
    # ("cached plan must not change result type"), or committed and then failed to
    # read its row, its run left running under it.
    left_by_an_earlier_release(empty_pg, "0002")
    before = _run_columns(empty_pg)
    migrate(empty_pg)
    assert _run_columns(empty_pg) == before


def _run_columns(url: str) -> list[str]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return [c["name"] for c in sa.inspect(conn).get_columns("agentruns_runs")]
    finally:
        engine.dispose()


def test_a_later_release_adding_a_column_leaves_this_releases_running_writes_working(
    empty_pg: str,
) -> None:
    # This release's claim and create returned r.* and *: prepared before a later
    # release's migration added a column (a rolling deploy), they failed ("cached
    # plan must not change result type"), or returned a row of unknown shape.
    migrate(empty_pg)
    store = SqlStore(empty_pg)
    first, _ = store.create_run(new_run())
    assert store.claim(first.id, "me", soon()) is not None  # both prepared now
    with psycopg.connect(empty_pg.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute("ALTER TABLE agentruns_runs ADD COLUMN later_release_column integer")
    second, created = store.create_run(new_run())
    assert created and second.status is RunStatus.QUEUED
    claimed = store.claim(second.id, "me", soon())
    assert claimed is not None and claimed.run.status is RunStatus.RUNNING
    store.close()


_APP_ENV = """
from alembic import context

context.configure(connection=context.config.attributes["connection"])
with context.begin_transaction():
    context.run_migrations()
"""
_APP_REVISION = """
import sqlalchemy as sa
from alembic import op

revision = "{revision}"
down_revision = None


def upgrade():
    op.create_table("app_users", sa.Column("id", sa.Integer, primary_key=True))
"""


def _app_upgrade(url: str, scripts: Path) -> str | None:
    """An application's own Alembic (its default version table) upgraded to its head."""
    from alembic import command
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext

    config = Config()
    config.set_main_option("script_location", str(scripts))
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            config.attributes["connection"] = conn
            command.upgrade(config, "head")
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def _revisions(url: str) -> dict[str, str | None]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            tables = sa.inspect(conn)
            return {
                table: conn.execute(sa.text(f"SELECT version_num FROM {table}")).scalar()
                for table in (VERSION_TABLE, LEGACY_VERSION_TABLE)
                if tables.has_table(table)
            }
    finally:
        engine.dispose()


@pytest.mark.parametrize("app_first", [True, False], ids=["app-first", "agentruns-first"])
@pytest.mark.parametrize("app_revision", ["ae1027a6acf", REVISIONS[1]], ids=["hex", "numbered"])
def test_an_applications_alembic_shares_the_database_with_agentruns(
    empty_pg: str, tmp_path: Path, app_first: bool, app_revision: str
) -> None:
    # Both recorded their revision in Alembic's default table: agentruns migrate
    # after the app's said "a newer release migrated it", and the app's upgrade
    # after agentruns' failed with "Can't locate revision identified by '0004'". An
    # app whose revisions are numbered as agentruns' are had its record taken for an
    # earlier release's and moved on to agentruns' newest, its migrations skipped.
    scripts = tmp_path / "app_migrations"
    (scripts / "versions").mkdir(parents=True)
    (scripts / "env.py").write_text(_APP_ENV)
    (scripts / "versions" / f"{app_revision}_users.py").write_text(
        _APP_REVISION.format(revision=app_revision)
    )
    for url in (empty_pg, f"sqlite:///{tmp_path}/shared.db"):
        if app_first:
            assert _app_upgrade(url, scripts) == app_revision
        for _ in range(2):  # every deploy runs both
            assert migrate(url) == HEAD
            assert _app_upgrade(url, scripts) == app_revision
        assert _revisions(url) == {VERSION_TABLE: HEAD, LEGACY_VERSION_TABLE: app_revision}
        Engine(url, agents=[Agent("a", ScriptedModel([text("ok")]))], secret="s").close()


def test_a_database_an_earlier_release_migrated_keeps_working_and_moves_its_revision(
    empty_pg: str, tmp_path: Path
) -> None:
    # Earlier releases recorded agentruns' revision in Alembic's default table.
    agent = Agent("a", ScriptedModel([text("ok")]))
    for url in (empty_pg, f"sqlite:///{tmp_path}/earlier.db"):
        left_by_an_earlier_release(url, HEAD)
        # The package upgraded with no new migration: engines start as they did.
        Engine(url, agents=[agent], secret="s").close()
        assert migrate(url) == HEAD
        assert _revisions(url) == {VERSION_TABLE: HEAD, LEGACY_VERSION_TABLE: HEAD}
        Engine(url, agents=[agent], secret="s").close()


def test_migrating_from_an_earlier_releases_revision_keeps_its_record_in_step(
    empty_pg: str,
) -> None:
    # An older worker that restarts reads Alembic's default table: it must find the
    # revision the migration brought (and refuse it, as a newer one), not the one
    # it had, on which it would run against a schema it does not know.
    left_by_an_earlier_release(empty_pg, REVISIONS[-2])
    store = SqlStore(empty_pg)
    with pytest.raises(NotMigratedError, match=f"at {REVISIONS[-2]}, need {HEAD}"):
        store.check_schema()
    assert migrate(empty_pg) == HEAD
    assert _revisions(empty_pg) == {VERSION_TABLE: HEAD, LEGACY_VERSION_TABLE: HEAD}
    store.check_schema()
    store.close()


def test_a_new_database_gets_no_table_of_alembics_default_name(
    empty_pg: str, tmp_path: Path
) -> None:
    for url in (empty_pg, f"sqlite:///{tmp_path}/new.db"):
        migrate(url)
        assert _revisions(url) == {VERSION_TABLE: HEAD}
