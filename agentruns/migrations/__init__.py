"""Alembic migrations shipped in the package, and the revisions they bring a database to.

An engine checks the revision when it starts, without Alembic: importing Alembic
costs a process about a quarter of a second and logs a screen of INFO lines."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

# Every revision in versions/, oldest first: a new migration adds its id here
# (a test holds this to Alembic's own history).
REVISIONS: tuple[str, ...] = ("0001", "0002", "0003", "0004", "0005")
HEAD = REVISIONS[-1]
# Where agentruns records a database's revision: a table of its own, so that an
# application's Alembic can share the database (each would take the other's
# revision in Alembic's default table for an unknown one of its own).
VERSION_TABLE = "agentruns_alembic_version"
# Where agentruns recorded it before it had a table of its own; ``migrate`` moves
# the record from there once (then an application's Alembic may use that table).
LEGACY_VERSION_TABLE = "alembic_version"
# The oldest revision whose releases work on the database (a row of its own table):
# an engine of a release that does not know the database's revision, which a newer
# release migrated, works on it if it knows this one (a prefork child that starts in
# a rolling deploy, once the new release's migrate ran). A migration that leaves the
# statements of the releases before it working (a table or an index of its own)
# leaves the floor as it is; one that breaks them raises it to itself. From 0005 on.
FLOOR_TABLE = "agentruns_schema_floor"
# The floor HEAD leaves (a test holds the migrations to it): a migration that breaks
# the statements of the releases before it sets the floor to itself, here and in its
# table; one that adds a table or an index leaves both as they are.
FLOOR = "0004"
# A table every agentruns schema has: Alembic's default table holds agentruns'
# revision only beside it (an application's revisions may be numbered alike).
_RUNS = "agentruns_runs"


def _version(conn: Connection, table: str) -> str | None:
    version = sa.table(table, sa.column("version_num", sa.String))
    return conn.execute(sa.select(version.c.version_num)).scalar()


def legacy_revision(conn: Connection) -> str | None:
    """The revision an earlier release recorded in Alembic's default table, if any (to
    be read only where agentruns' own table is not: else it may be an application's)."""
    tables = sa.inspect(conn)
    if not (tables.has_table(LEGACY_VERSION_TABLE) and tables.has_table(_RUNS)):
        return None
    legacy = _version(conn, LEGACY_VERSION_TABLE)
    return legacy if legacy in REVISIONS else None


def schema_floor(conn: Connection) -> str | None:
    """The oldest revision whose releases work on the database, if it says."""
    if not sa.inspect(conn).has_table(FLOOR_TABLE):
        return None
    floor = sa.table(FLOOR_TABLE, sa.column("revision", sa.String))
    # One row; should a hand edit leave more, the newest (the strictest) counts.
    return conn.execute(sa.select(sa.func.max(floor.c.revision))).scalar()


def works_here(conn: Connection, current: str | None) -> str | None:
    """The floor, if the database is at a revision this release does not know (a newer
    release migrated it) and says this release works on it; else None."""
    if current is None or current in REVISIONS:
        return None
    floor = schema_floor(conn)
    return floor if floor in REVISIONS else None


def current_revision(conn: Connection) -> str | None:
    """The revision the database is at; ``None`` if it was never migrated."""
    if sa.inspect(conn).has_table(VERSION_TABLE):
        return _version(conn, VERSION_TABLE)
    return legacy_revision(conn)
