"""Configuration from ``AGENTRUNS_*`` environment variables (read when first used)."""

from __future__ import annotations

from functools import cache
from typing import TypeGuard
from urllib.parse import urlsplit

import sqlalchemy as sa
from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from agentruns.errors import InvalidSettingError

# The longest time any setting in seconds may name (a year): a lease's expiry, a
# requeue age or a beat interval must still be a date.
MAX_SECONDS = 365 * 24 * 3600
# Runs one engine executes at once: each is a thread (close() took 34 s at 10^7).
MAX_SLOTS = 10_000


class Settings(BaseSettings):
    # A URL's password is not repeated in a refusal's text (a worker logs it).
    model_config = SettingsConfigDict(
        env_prefix="AGENTRUNS_", extra="ignore", hide_input_in_errors=True
    )

    database_url: str = "sqlite:///agentruns.db"
    # Postgres connections one process keeps at most (opened as needed, then kept).
    database_pool_size: int = Field(default=30, ge=1)
    redis_url: str | None = None
    broker_url: str | None = None
    secret: str | None = None
    agents: str = "workers.triage"
    lease_ttl: float = Field(default=30.0, gt=0, le=MAX_SECONDS, allow_inf_nan=False)
    slots: int = Field(default=8, ge=1, le=MAX_SLOTS)
    requeue_after: float = Field(default=60.0, gt=0, le=MAX_SECONDS, allow_inf_nan=False)
    tick_interval: float = Field(default=5.0, gt=0, le=MAX_SECONDS, allow_inf_nan=False)
    recover_interval: float = Field(default=15.0, gt=0, le=MAX_SECONDS, allow_inf_nan=False)
    # The Celery queue: several deployments (or test sessions) can share one Redis.
    queue: str = "agentruns"

    @field_validator("secret")
    @classmethod
    def _empty_secret_is_unset(cls, value: str | None) -> str | None:
        # `AGENTRUNS_SECRET=` in an env file means "not set", not "sign with no key".
        return value or None

    @field_validator("queue")
    @classmethod
    def _a_queue_name(cls, value: str) -> str:
        # `AGENTRUNS_QUEUE=` (an unset variable in a compose file) named the queue "":
        # producers' messages went where workers did not look, and were lost unsaid.
        if not value.strip():
            raise ValueError("the Celery queue's name must not be empty (unset: agentruns)")
        return value

    @field_validator("database_url")
    @classmethod
    def _a_database_url(cls, value: str) -> str:
        # Refused here, its setting named, rather than as an unexpected ValueError
        # wherever the URL is first used.
        try:
            sa.make_url(value).port  # noqa: B018  (the port is parsed when read)
        except (ValueError, sa.exc.ArgumentError) as exc:
            raise ValueError(f"not a database URL ({_why(value, exc)})") from None
        from agentruns.store.connect import unsupported

        problem = unsupported(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("redis_url")
    @classmethod
    def _a_redis_url(cls, value: str | None) -> str | None:
        return _redis_url(value) if value else value

    @field_validator("broker_url")
    @classmethod
    def _a_broker_url(cls, value: str | None) -> str | None:
        # Another broker's URL (amqp://) is kombu's to judge; so is a list of them
        # (``;`` between failover alternates), each Redis one checked on its own.
        for alternate in (value or "").split(";"):
            if alternate.strip().startswith(_REDIS_SCHEMES):
                _redis_url(alternate.strip())
        return value

    @property
    def agent_modules(self) -> list[str]:
        return [m.strip() for m in self.agents.split(",") if m.strip()]

    @property
    def effective_broker_url(self) -> str | None:
        return self.broker_url or self.redis_url


_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def is_redis_url(url: str | None) -> TypeGuard[str]:
    """Does the URL name a Redis (redis-py's schemes: TCP, TLS or a Unix socket)?"""
    return url is not None and url.startswith(_REDIS_SCHEMES)


def _redis_url(value: str) -> str:
    from redis.connection import parse_url

    try:
        parse_url(value)  # type: ignore[no-untyped-call]  # scheme, port, options
    except ValueError as exc:
        raise ValueError(f"not a Redis URL ({_why(value, exc)})") from None
    number = urlsplit(value).path.strip("/")
    if not value.startswith("unix://") and number and not number.isdigit():
        # redis-py took it as database 0; Celery's transport refused it.
        raise ValueError(f"a Redis URL's path is its database number, not {number!r}")
    return value


def _why(url: str, exc: Exception) -> str:
    """What the parser said of a URL, unless the URL holds a password: a ``/`` or ``:``
    in one that is not percent-encoded is a common cause, and the parser then quotes
    a piece of it as the port or the host."""
    if "@" not in url:
        return str(exc)
    return "if its password holds a '/', ':', '@' or '#', percent-encode them (%2F, %3A, %40, %23)"


def read_settings() -> Settings:
    """The settings the environment gives, read now; a variable they cannot take is
    named, in one line (``InvalidSettingError``), not in pydantic's text."""
    try:
        return Settings()
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(p) for p in problem["loc"])
        said = problem["msg"].removeprefix("Value error, ")  # pydantic's, for a validator's
        raise InvalidSettingError(f"invalid setting AGENTRUNS_{where.upper()}: {said}") from None


@cache
def get_settings() -> Settings:
    return read_settings()
