"""Every failure the CLI can meet, as one line and an exit code (2: bad input, 1: the rest)."""

from __future__ import annotations

from pathlib import Path

import redis
import sqlalchemy
import sqlalchemy.exc

from agentruns.errors import (
    AgentrunsError,
    InvalidSettingError,
    InvalidTokenError,
    InvalidTriggerError,
    NotMigratedError,
    NotRetryableError,
    RunNotFoundError,
    UnknownAgentError,
    first_line,
)
from agentruns.store.connect import shown_url

BAD_INPUT = 2
FAILURE = 1

TOKEN_PROBLEMS = {
    "malformed": "this is not a resume token",
    "bad_signature": "its signature does not match (altered, or minted with another "
    "AGENTRUNS_SECRET)",
    "expired": "the approval it answers has expired",
    "stale": "the run is no longer waiting on it (already answered, cancelled or replaced)",
}


class CliError(Exception):
    """A failure the CLI has already put into words."""

    def __init__(self, message: str, code: int = FAILURE) -> None:
        super().__init__(message)
        self.code = code


def describe(exc: BaseException, database_url: str, redis_url: str | None) -> tuple[int, str]:
    """The exit code and the one line to print for an exception."""
    if isinstance(exc, CliError):
        return exc.code, str(exc)
    if isinstance(exc, InvalidTokenError):
        detail = exc.detail or TOKEN_PROBLEMS[exc.reason]
        return BAD_INPUT, f"invalid resume token ({exc.reason}): {detail}"
    if isinstance(exc, RunNotFoundError):
        return BAD_INPUT, f"no run with id {exc.run_id!r} (see `agentruns runs`)"
    if isinstance(exc, UnknownAgentError | InvalidTriggerError | NotRetryableError):
        return BAD_INPUT, str(exc)
    if isinstance(exc, InvalidSettingError):
        return BAD_INPUT, str(exc)
    database = shown_url(database_url)
    if isinstance(exc, NotMigratedError):
        cause = exc.__cause__
        if isinstance(cause, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError):
            return FAILURE, database_failure(database, cause)
        return FAILURE, str(exc)
    if isinstance(exc, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError):
        return FAILURE, database_failure(database, exc)
    if isinstance(exc, sqlalchemy.exc.SQLAlchemyError):
        return (
            FAILURE,
            f"database error on {database}: {first_line(getattr(exc, 'orig', exc), typed=False)}",
        )
    if isinstance(exc, redis.RedisError):
        where = shown_url(redis_url) if redis_url else "Redis"
        return (
            FAILURE,
            f"cannot reach Redis at {where}: {first_line(exc, typed=False)} (AGENTRUNS_REDIS_URL)",
        )
    if type(exc).__module__.startswith("kombu"):
        said = first_line(exc, typed=False)
        return FAILURE, f"cannot reach the Celery broker: {said} (AGENTRUNS_BROKER_URL)"
    if isinstance(exc, AgentrunsError):
        return FAILURE, first_line(exc, typed=False)
    return FAILURE, f"unexpected {type(exc).__name__}: {first_line(exc, typed=False)}"


def database_failure(database: str, exc: sqlalchemy.exc.DBAPIError) -> str:
    """A database that could not be opened (the URL, the server, the file) gets advice
    on those; one that failed a statement (a full disk, a dropped connection), its error."""
    said = first_line(exc.orig or exc, typed=False)
    if database.startswith("sqlite"):
        # SQLite opens its file lazily: a COMMIT that fails (a full disk) has no
        # statement either; only this error is the file's that could not be opened.
        opening = "unable to open database file" in said
    else:
        opening = exc.statement in (None, "connect")  # connecting: no statement was sent
    if opening:
        return unreachable_database(database, exc)
    return f"database error on {database}: {said}"


def _sqlite_advice(database: str) -> str:
    """Why SQLite may not open the file ``database`` names."""
    path = Path(sqlalchemy.make_url(database).database or "")
    if path.is_dir():
        return f"{path} is a directory: name a file in it"
    if not path.parent.is_dir():
        return f"the directory {path.parent} does not exist: create it first"
    return (
        f"SQLite must be able to write the file and, in {path.parent}, its -wal and -shm"
        " files beside it; check AGENTRUNS_DATABASE_URL"
    )


def unreachable_database(database: str, exc: sqlalchemy.exc.DBAPIError) -> str:
    said = first_line(exc.orig or exc, typed=False)
    if database.startswith("sqlite"):
        return f"cannot open the database {database}: {said} ({_sqlite_advice(database)})"
    if 'database "' in said and "does not exist" in said:
        # `agentruns migrate` makes the tables, not the database (it said to run it).
        advice = "create it (`createdb`, or your provider's console), then `agentruns migrate`"
    else:
        advice = "check AGENTRUNS_DATABASE_URL; a new database needs `agentruns migrate`"
    return f"cannot open the database {database}: {said} ({advice})"
