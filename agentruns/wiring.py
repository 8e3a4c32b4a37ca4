"""Building an engine from settings: the store, leases, scheduler and agents they name."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypedDict, Unpack

from agentruns.agent import Agent
from agentruns.errors import AgentrunsError, first_line
from agentruns.settings import Settings, get_settings

if TYPE_CHECKING:
    from agentruns.engine import Engine
    from agentruns.leases.base import Leases
    from agentruns.schedulers.base import Scheduler
    from agentruns.store.base import Store


class EngineOptions(TypedDict, total=False):
    """``Engine``'s keyword arguments, which ``Engine.from_settings`` takes over the
    settings' (so a type checker knows them: a misspelt one is an error)."""

    store: Store | str
    leases: Leases | None
    scheduler: Scheduler | None
    agents: Sequence[Agent]
    secret: str | None
    owner: str | None
    slots: int
    lease_ttl: float
    requeue_after: float
    on_error: Callable[[Exception], None] | None


def cwd_on_path() -> None:
    """Put the working directory first on ``sys.path``, as ``python -m`` and ``celery
    -A`` do, and leave it there: agent modules are found from a project's root, and
    so are the modules their tools import later, when they run (in a worker too)."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)


def load_agents(modules: list[str]) -> list[Agent]:
    """Every ``Agent`` defined at module level in the given modules, which are found
    from the working directory too (``AGENTRUNS_AGENTS=workers.triage`` from a
    project's root)."""
    cwd_on_path()
    found: dict[str, tuple[Agent, str]] = {}  # by name: the agent, and its module
    for name in modules:
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            # Whatever a module raised (a config file it opens not there: OSError) is
            # the deployment's mistake, not an outage of the database or Redis: a
            # worker that took it for one acked the sweeps and nudges it could not run.
            raise AgentrunsError(
                f"cannot import the agent modules {','.join(modules)!r} (AGENTRUNS_AGENTS):"
                f" {first_line(exc)}"
            ) from exc
        for value in vars(module).values():
            if not isinstance(value, Agent):
                continue
            seen = found.setdefault(value.name, (value, name))
            if seen[0] is not value:
                raise AgentrunsError(
                    f"two agents are named {value.name!r}, in {seen[1]} and {name}"
                    " (AGENTRUNS_AGENTS): an agent's name picks its runs' code"
                )
    return [agent for agent, _ in found.values()]


def engine_from_settings(
    settings: Settings | None = None, **overrides: Unpack[EngineOptions]
) -> Engine:
    from agentruns.engine import Engine
    from agentruns.leases import LocalLeases, RedisLeases
    from agentruns.schedulers import CeleryScheduler, LocalScheduler
    from agentruns.store import SqlStore

    s = settings or get_settings()
    shared = isinstance(overrides["leases"], RedisLeases) if "leases" in overrides else s.redis_url
    if shared and not overrides.get("secret", s.secret):
        # Several processes: a token one mints must pass in another.
        raise AgentrunsError(
            "AGENTRUNS_SECRET is not set: with leases in Redis (AGENTRUNS_REDIS_URL, or a"
            " worker's Redis broker), every process needs the same secret to sign and check"
            " resume tokens"
        )
    # Before anything is built for the engine: nothing is left open when they fail.
    agents = overrides["agents"] if "agents" in overrides else load_agents(s.agent_modules)
    store = SqlStore(s.database_url, pool_size=s.database_pool_size)
    kwargs: EngineOptions = {
        "store": store,
        "agents": agents,
        "secret": s.secret,
        "slots": s.slots,
        "lease_ttl": s.lease_ttl,
        "requeue_after": s.requeue_after,
    }
    leases: Leases = RedisLeases(s.redis_url) if s.redis_url else LocalLeases()
    kwargs["leases"] = leases
    kwargs["scheduler"] = CeleryScheduler() if s.redis_url else LocalScheduler()
    built: list[Store | Leases] = [store, leases]
    kwargs.update(overrides)
    try:
        engine = Engine(**kwargs)
    except BaseException:
        # What was built here for it (a worker on a database not migrated yet builds
        # an engine for each message it gives back: each left a connection open).
        for part in built:
            part.close()
        raise
    if s.redis_url and isinstance(kwargs["leases"], RedisLeases):
        from agentruns.broadcast import EventPublisher

        publisher = EventPublisher(s.redis_url)
        engine.on("run.updated", publisher)
        engine.on("step.appended", publisher)
        engine.close_with(publisher.close)
    return engine
