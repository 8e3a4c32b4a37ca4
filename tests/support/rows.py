"""Rows the store tests write directly, without an engine."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from agentruns import TriggerEnvelope
from agentruns.runs import utcnow
from agentruns.store.base import NewRun


def new_run(key: str | None = None, idem: str | None = None) -> NewRun:
    return NewRun(
        id=str(uuid.uuid4()),
        agent="a",
        trigger=TriggerEnvelope(source="manual", trigger="manual", payload={}),
        idempotency_key=idem,
        concurrency_key=key,
        thread=None,
        budget=None,
    )


def soon() -> datetime:
    """A claim's expiry half a minute from now."""
    return utcnow() + timedelta(seconds=30)
