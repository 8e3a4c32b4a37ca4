"""Applying the Alembic migrations shipped in the package (``agentruns migrate``)."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from agentruns.errors import AgentrunsError
from agentruns.migrations import (
    HEAD,
    LEGACY_VERSION_TABLE,
    REVISIONS,
    VERSION_TABLE,
    current_revision,
    legacy_revision,
    works_here,
)
from agentruns.store.connect import make_engine

_SCRIPTS = str(Path(__file__).parent / "migrations")
# The advisory lock migrations take on Postgres (any constant of agentruns' own).
_LOCK = 0x61676E7472756E73  # "agntruns"
# How long a migration waits for a table lock (see migrate).
LOCK_TIMEOUT_S = 10.0
_LOCK_NOT_AVAILABLE = "55P03"


def _config() -> Config:
    config = Config()
    config.set_main_option("script_location", _SCRIPTS)
    return config


def migrate(url: str, lock_timeout: float = LOCK_TIMEOUT_S) -> str | None:
    """Bring the database at ``url`` up to the newest schema; returns the revision.
    A database a newer release migrated is left as it is if it says this release
    works on it (its revision returned); else ``AgentrunsError``.

    On Postgres, a table lock a migration needs is waited for ``lock_timeout``
    seconds at most: while it waits, every write to that table waits behind it (a
    worker's too). Past that, nothing has changed, and ``AgentrunsError`` says so."""
    engine = make_engine(url, create=True)
    try:
        return _migrate(engine, lock_timeout)
    except sa.exc.OperationalError as exc:
        # A table lock waited for past lock_timeout, by the read of the revision (its
        # table locked), the move of a legacy record, or a migration: one transaction,
        # rolled back, so nothing has changed.
        if getattr(exc.orig, "sqlstate", None) != _LOCK_NOT_AVAILABLE:
            raise
        raise AgentrunsError(
            f"the migration waited {lock_timeout:g} s for a table lock that another "
            "transaction holds (a long query?); it changed nothing: run it again"
        ) from exc
    finally:
        engine.dispose()


def _migrate(engine: sa.Engine, lock_timeout: float) -> str | None:
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # One migration at a time (several deploys may run it at once): the
            # others wait for this transaction, then find nothing left to do.
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK})
            conn.execute(
                sa.text("SELECT set_config('lock_timeout', :ms, true)"),
                {"ms": f"{max(1, round(lock_timeout * 1000))}ms"},
            )
        current = current_revision(conn)
        if works_here(conn, current) is not None:
            # A newer release migrated it, and says this one works on it: nothing to do
            # (a deploy rolled back, whose services wait on migrate to succeed).
            return current
        if current is not None and current not in REVISIONS:
            # Alembic's own word for it: "Can't locate revision identified by …".
            raise AgentrunsError(
                f"the database is at schema {current}, newer than this release of"
                f" agentruns knows (its newest is {HEAD}): a newer release migrated it;"
                " run that release's `agentruns migrate`, or nothing"
            )
        config = _config()
        config.attributes["connection"] = conn
        moved = None
        if not sa.inspect(conn).has_table(VERSION_TABLE):
            # Migrated by a release that recorded it in Alembic's default table:
            # the revision moves to agentruns' own before anything else. From then
            # on that table is left alone: an application's Alembic may use it.
            moved = legacy_revision(conn)
            if moved is not None:
                command.stamp(config, moved)
        command.upgrade(config, "head")
        revision = current_revision(conn)
        if moved not in (None, revision):
            # The record just moved is the older workers': brought to the new
            # revision with it, an old one that restarts refuses the database a
            # newer release migrated, as it always did.
            conn.execute(
                sa.text(
                    f"UPDATE {LEGACY_VERSION_TABLE} SET version_num = :revision"
                    " WHERE version_num = :moved"
                ),
                {"revision": revision, "moved": moved},
            )
        return revision
