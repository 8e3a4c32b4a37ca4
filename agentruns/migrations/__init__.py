"""Alembic migrations shipped in the package, and the revisions they bring a database to.

An engine checks the revision when it starts, without Alembic: importing Alembic
costs a process about a quarter of a second and logs a screen of INFO lines."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

# Every revision in versions/, oldest first: a new migration adds its id here
# (a test holds this to Alembic's own history).
REVISIONS: tuple[str, ...] = ("0001", "0002", "0003", "0004")
HEAD = REVISIONS[-1]
# Where Alembic records a database's revision (its default).
VERSION_TABLE = "alembic_version"


def current_revision(conn: Connection) -> str | None:
    """The revision the database is at; ``None`` if it was never migrated."""
    if not sa.inspect(conn).has_table(VERSION_TABLE):
        return None
    version = sa.table(VERSION_TABLE, sa.column("version_num", sa.String))
    return conn.execute(sa.select(version.c.version_num)).scalar()
