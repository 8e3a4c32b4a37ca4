"""A Celery worker's own engine, one per process, and its drain when the worker stops.

The engine is built from ``AGENTRUNS_*`` settings the first time a task needs
it, once per process: a prefork child builds its own after the fork, so no
database or Redis connection crosses a fork. Warm shutdown, a remote
``shutdown`` and (but in a prefork pool, whose processes Celery kills) cold
shutdown drain it: runs in flight settle ``interrupted`` and ``recover`` gives
them to another worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from celery import signals

from agentruns.celery import SWEEPS
from agentruns.errors import NotMigratedError, first_line
from agentruns.outages import is_outage
from agentruns.settings import MAX_SLOTS, get_settings, is_redis_url

if TYPE_CHECKING:
    from agentruns.engine import Engine

log = logging.getLogger("agentruns")

# How long warm shutdown waits for in-flight runs to settle ``interrupted``;
# a tool call in progress is never cut short, so this bounds the wait, not the work.
DRAIN_TIMEOUT_S = 10.0
# Sent by the worker's main process to its prefork children: "drain now".
_DRAIN_SIGNAL = signal.SIGUSR2

# -- the process's engine -------------------------------------------------------------

_engine: Engine | None = None
_engine_lock = threading.Lock()
# In a worker's process, a build that failed for the deployment's own mistake (an
# agent module that does not import, a setting), and when: tried again only after a
# while, not for each message given back (the module's code ran again each time, what
# it started piling up). Elsewhere (a team's tests, eager) each call builds again.
_failed: tuple[float, Exception] | None = None
_BUILD_AGAIN_AFTER_S = 10.0
_a_workers_process = False  # set as the worker (or a prefork child of it) starts
_slots: int | None = None  # the pool's concurrency, once the worker knows it
_shutting_down = threading.Event()


def get_engine(app: Any = None) -> Engine:
    """This process's engine, built from settings on first use. ``app`` is the Celery
    app whose worker runs here (a team's own app that includes ``agentruns.tasks``):
    the engine sends its executions through it, to the queues its worker consumes,
    and takes its leases from its broker's Redis unless ``AGENTRUNS_REDIS_URL`` says
    otherwise. By default, ``agentruns.celery.app``."""
    global _engine, _failed
    with _engine_lock:
        if _engine is None:
            if _failed is not None and time.monotonic() - _failed[0] < _BUILD_AGAIN_AFTER_S:
                raise _failed[1].with_traceback(None)  # (its traceback was logged)
            try:
                _engine = _build_engine(app)
            except Exception as exc:
                mistake = not is_outage(exc) and not isinstance(exc, NotMigratedError)
                if mistake and _a_workers_process:
                    _failed = (time.monotonic(), exc)
                raise
            _failed = None
        return _engine


def shutting_down() -> bool:
    """True once this process has started to drain; executions it receives go back."""
    return _shutting_down.is_set()


_told_why = threading.Event()


def say_once_why_there_is_no_engine(exc: BaseException) -> None:
    """Log, once per process, why its engine cannot be built (a module that fails to
    import, wrong settings), in full; each message given back for it says one line."""
    if not _told_why.is_set():
        _told_why.set()
        log.error(
            "agentruns: this worker cannot build its engine; it gives every message "
            "back to the queue, for another worker, until it is mended and restarted",
            exc_info=exc,
        )


def _build_engine(app: Any = None) -> Engine:
    from agentruns.engine import Engine
    from agentruns.leases import LocalLeases, RedisLeases
    from agentruns.schedulers.celery import CeleryScheduler

    if app is None:
        from agentruns.celery import app
    settings = get_settings()
    overrides: dict[str, Any] = {"scheduler": CeleryScheduler(app)}
    if settings.redis_url is None and app.conf.task_always_eager:
        # Every task runs in its caller (a team's tests): nothing but this process
        # holds a run, and the app's broker may be none (memory://).
        overrides["leases"] = LocalLeases()
    elif settings.redis_url is None:
        # Leases must be shared by every worker: without AGENTRUNS_REDIS_URL, use
        # the broker's Redis rather than the in-process leases of the embedded mode.
        broker = str(app.conf.broker_url or "")
        if not is_redis_url(broker):
            raise RuntimeError("agentruns workers need Redis for leases: set AGENTRUNS_REDIS_URL")
        overrides["leases"] = RedisLeases(broker)
    if _slots is not None:
        # Every pool slot may hold a run; the pool, not the engine, is the limit here.
        overrides["slots"] = min(MAX_SLOTS, max(settings.slots, _slots))
    # Agent modules (AGENTRUNS_AGENTS) import from the working directory (load_agents).
    engine = Engine.from_settings(**overrides)
    log.info(
        "agentruns engine %s ready: %d slots, agents %s",
        engine.owner,
        engine.slots,
        ", ".join(engine.agents),
    )
    return engine


def pool_kind(pool: Any) -> str:
    """``prefork``, ``thread``, ``solo``, ``gevent``…: the module that implements the pool."""
    return str(type(pool).__module__).rpartition(".")[2]


# -- worker signals ---------------------------------------------------------------------

_pool: Any = None  # the worker's pool, known from worker_ready


def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    global _pool, _slots, _a_workers_process
    _a_workers_process = True
    _pool = getattr(sender, "pool", None)
    limit = getattr(_pool, "limit", None)
    _slots = limit if isinstance(limit, int) and limit > 0 else None
    _say_if_the_sweeps_queue_is_not_consumed(sender)
    # The sender is the worker's consumer; its controller holds the pool's limits.
    soft = getattr(getattr(sender, "controller", None), "soft_time_limit", None)
    if soft:
        log.warning(
            "agentruns: its tasks ignore the worker's soft time limit (%s s): it would "
            "stop every execution longer than it, again after each recovery; "
            "Budget.timeout_s bounds a run instead",
            soft,
        )
    if _pool is not None and pool_kind(_pool) != "prefork":
        # This process runs the tasks. Fail loudly at start (unmigrated database,
        # unknown agent module), not per task; tasks try again until it works.
        try:
            get_engine(getattr(sender, "app", None))
        except Exception as exc:
            if is_outage(exc):  # one line, as each sweep says it
                log.warning(
                    "agentruns: could not build the engine (%s); its tasks try again",
                    first_line(exc),
                )
            elif isinstance(exc, NotMigratedError):  # no restart needed: `agentruns migrate`
                log.error(
                    "agentruns: %s (until then, this worker gives every message back)",
                    first_line(exc, typed=False),
                )
            else:
                say_once_why_there_is_no_engine(exc)


def _say_if_the_sweeps_queue_is_not_consumed(consumer: Any) -> None:
    """A worker started with ``-Q`` naming the runs' queue alone never gets beat's
    sweeps: if no worker does, approvals never expire and lost runs stay lost. The
    queues are where the tasks are routed (a deployment's ``task_routes`` may send
    the sweeps elsewhere than the sweeps queue beside the runs')."""
    app = getattr(consumer, "app", None)
    task_consumer = getattr(consumer, "task_consumer", None)
    if app is None or task_consumer is None:
        return
    runs = _routed_queue(app, "agentruns.execute")
    consumed = {q.name for q in task_consumer.queues}
    sweeps = {_routed_queue(app, task) for task in SWEEPS}
    missing = sorted(q for q in sweeps if q is not None and q not in consumed)
    if runs in consumed and missing:
        log.warning(
            "agentruns: this worker does not consume %s, where beat sends tick and "
            "recover (and cancels go); unless another worker does, they never run (-Q %s)",
            ", ".join(map(repr, missing)),
            ",".join(sorted(consumed | set(missing))),
        )


def _routed_queue(app: Any, task: str) -> str | None:
    """The name of the queue the app's router sends ``task`` to. (Asked of its
    routes, not its ``route()``, which adds a queue it routes to and does not know
    to the queues a worker without ``-Q`` consumes after a reconnection.)"""
    try:
        route = app.amqp.router.lookup_route(task, (), {}, {})
    except Exception:
        log.debug("agentruns: could not route %s", task, exc_info=True)
        return None
    if route is None:
        queue = app.conf.task_default_queue
    else:  # a dict without a queue routes by exchange: not said here
        queue = route.get("queue") if isinstance(route, dict) else route
    name = getattr(queue, "name", queue)
    return name if isinstance(name, str) else None


def _on_worker_process_init(**_: Any) -> None:
    """A prefork child: forget anything inherited, build its own engine on first use."""
    global _engine, _engine_lock, _failed, _a_workers_process
    # The inherited engine's sockets belong to the parent: drop it, don't close it.
    _engine = None
    _failed = None
    _a_workers_process = True
    _engine_lock = threading.Lock()  # another thread may have held it at the fork
    _shutting_down.clear()
    _told_why.clear()
    signal.signal(_DRAIN_SIGNAL, _on_drain_signal)


def _on_drain_signal(signum: int, frame: Any) -> None:
    _shutting_down.set()
    _start_drain()


def _start_drain() -> threading.Thread:
    # Never in the signal handler itself: the thread it interrupted may hold the
    # engine's locks, or (prefork, solo) be the very execution that must settle.
    drainer = threading.Thread(target=_drain, name="agentruns-drain", daemon=True)
    drainer.start()
    return drainer


def _drain() -> None:
    engine = _engine
    if engine is None:
        return
    try:
        engine.drain(timeout=DRAIN_TIMEOUT_S)
    except Exception:
        log.exception("agentruns: drain failed")


def begin_shutdown(**_: Any) -> None:
    """The worker stops, warm or cold, for any cause: its in-flight runs settle
    ``interrupted`` and release their claims, once. Their tasks then return and
    their messages are acked; ``recover`` requeues the runs for another worker.

    Called on ``worker_shutting_down``, which Celery sends only from its signal
    handlers, and by the consumer as it closes (a remote ``shutdown`` sends no
    signal, and the pool would wait for every run in flight to finish) or as a
    cold shutdown cancels its tasks: whichever comes first drains."""
    if not _shutting_down.is_set():
        _shutting_down.set()
        _drain_pool()


def _drain_pool() -> None:
    pool = _pool
    kind = pool_kind(pool) if pool is not None else "thread"
    if kind == "prefork":
        # The runs are in the children; each drains on this signal. (After a cold
        # shutdown cancelled their tasks, the pool is stopped and they are gone.)
        try:
            children = pool.info.get("processes", [])
        except AttributeError:
            children = []
        for pid in children:
            with contextlib.suppress(OSError):  # already gone
                os.kill(pid, _DRAIN_SIGNAL)
        return
    drainer = _start_drain()
    if kind == "thread":
        # The runs are in pool threads: wait until they settle, so that their
        # tasks return (and their messages are acked) before Celery stops consuming.
        drainer.join(DRAIN_TIMEOUT_S + 1)


def _on_shutdown(**_: Any) -> None:
    global _engine
    with _engine_lock:
        engine = _engine
    if engine is not None:
        # Closed while it is still this process's: a notifier that close() waits for
        # and that answers through get_engine() reaches it, not a new engine built
        # then and never closed.
        try:
            engine.close()
        except Exception:
            log.exception("agentruns: closing the engine failed")
    with _engine_lock:
        if _engine is engine:
            _engine = None


signals.worker_ready.connect(_on_worker_ready)
signals.worker_process_init.connect(_on_worker_process_init)
signals.worker_shutting_down.connect(begin_shutdown)
signals.worker_process_shutdown.connect(_on_shutdown)
signals.worker_shutdown.connect(_on_shutdown)
