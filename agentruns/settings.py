"""Configuration from ``AGENTRUNS_*`` environment variables (read when first used)."""

from __future__ import annotations

from functools import cache

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# The longest time any setting in seconds may name (a year): a lease's expiry, a
# requeue age or a beat interval must still be a date.
MAX_SECONDS = 365 * 24 * 3600


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AGENTRUNS_", extra="ignore")

    database_url: str = "sqlite:///agentruns.db"
    # Postgres connections one process keeps at most (opened as needed, then kept).
    database_pool_size: int = Field(default=30, ge=1)
    redis_url: str | None = None
    broker_url: str | None = None
    secret: str | None = None
    agents: str = "workers.triage"
    lease_ttl: float = Field(default=30.0, gt=0, le=MAX_SECONDS, allow_inf_nan=False)
    slots: int = Field(default=8, ge=1)
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

    @property
    def agent_modules(self) -> list[str]:
        return [m.strip() for m in self.agents.split(",") if m.strip()]

    @property
    def effective_broker_url(self) -> str | None:
        return self.broker_url or self.redis_url


@cache
def get_settings() -> Settings:
    return Settings()
