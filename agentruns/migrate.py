"""Applying and checking the Alembic migrations shipped in the package."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection

from agentruns.store.connect import make_engine

_SCRIPTS = str(Path(__file__).parent / "migrations")
# The advisory lock migrations take on Postgres (any constant of agentruns' own).
_LOCK = 0x61676E7472756E73  # "agntruns"


def _config() -> Config:
    config = Config()
    config.set_main_option("script_location", _SCRIPTS)
    return config


@cache
def head_revision() -> str | None:
    return ScriptDirectory.from_config(_config()).get_current_head()


@cache
def known_revisions() -> frozenset[str]:
    """The revisions this release's migrations know."""
    return frozenset(s.revision for s in ScriptDirectory.from_config(_config()).walk_revisions())


def current_revision(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def migrate(url: str) -> str | None:
    """Bring the database at ``url`` up to the newest schema; returns the revision."""
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                # One migration at a time (several deploys may run it at once): the
                # others wait for this transaction, then find nothing left to do.
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK})
            config = _config()
            config.attributes["connection"] = conn
            command.upgrade(config, "head")
            return current_revision(conn)
    finally:
        engine.dispose()
