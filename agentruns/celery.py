"""The Celery app (``celery -A agentruns worker``), configured.

Configuration is :func:`defaults` (from ``AGENTRUNS_*``), then the top-level
``celeryconfig`` module when it can be imported (the repository's, or a
deployment's own), which starts from the same defaults and may override them.
A worker's own engine, and how it drains when the worker stops, are
``agentruns.worker``'s, whose signal handlers the tasks' module
(``agentruns.tasks``, which every worker imports) connects by importing it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from importlib.machinery import ModuleSpec
from typing import Any

import click
from celery import Celery
from celery.app.amqp import AMQP as CeleryAMQP
from celery.app.routes import Router, prepare
from celery.utils.imports import cwd_in_path
from kombu.entity import Exchange, Queue
from kombu.utils.url import maybe_sanitize_url

from agentruns.broker import transport_for
from agentruns.errors import InvalidSettingError
from agentruns.settings import Settings, get_settings

log = logging.getLogger("agentruns")

# How far apart two hosts' clocks may be without a sweep sent by one (beat)
# looking expired to the other (a worker).
CLOCK_SKEW_S = 60.0


# Beat's sweeps: the tasks beat sends, and the names of their schedule entries.
SWEEPS = ("agentruns.tick", "agentruns.recover")
# What goes to the sweeps' queue: the sweeps, and cancels, which waited behind the
# whole backlog of runs (a run was done before its cancel came, under load).
AHEAD = (*SWEEPS, "agentruns.cancel")


def sweeps_queue(queue: str) -> str:
    """The queue of beat's sweeps (``tick`` and ``recover``), and of cancels, beside the
    runs' ``queue`` (``AHEAD``)."""
    return f"{queue}.sweeps"


def _queues(queue: str) -> dict[str, Any]:
    """The queues workers consume and the sweeps' routes, for the runs' ``queue``."""
    return {
        "task_queues": [_queue(queue), _queue(sweeps_queue(queue))],
        "task_routes": {task: {"queue": sweeps_queue(queue)} for task in AHEAD},
    }


# RabbitMQ's default consumer_timeout, in seconds.
_AMQP_CONSUMER_TIMEOUT = 1800


def _is_amqp(url: str) -> bool:
    return url.split("://", 1)[0].lower() in {"amqp", "amqps", "pyamqp", "librabbitmq"}


def _queue(name: str) -> Any:
    """A queue as Celery declares its default one: a direct exchange and routing key
    of the queue's own name."""
    return Queue(name, Exchange(name, type="direct"), routing_key=name)  # type: ignore[no-untyped-call]


class SettingRefusedError(InvalidSettingError, click.ClickException):
    """An ``InvalidSettingError`` met while Celery's configuration was read: Celery's
    command line (click) says it in one line, ``Error: invalid setting …``, and exits 2
    (a worker or beat ended on a whole traceback); code that catches
    ``InvalidSettingError`` still does."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        click.ClickException.__init__(self, message)


def _settings() -> Settings:
    try:
        return get_settings()
    except InvalidSettingError as exc:
        raise SettingRefusedError(str(exc)) from None


def defaults() -> dict[str, Any]:
    """agentruns' Celery settings, from ``AGENTRUNS_*``; ``celeryconfig.py`` starts from these.

    Every message is an at-least-once nudge: the run's claim (a Redis lease plus
    an epoch in Postgres) decides who executes it, so a duplicate, a redelivery
    or a lost message is harmless. These settings lean on that: they prefer
    delivering a message twice to losing it, and they never hold a run inside
    the broker (no ETA or countdown), because ``recover`` finds anything a lost
    message leaves behind.
    """
    s = _settings()
    # Redis redelivers a message nobody acked within the visibility timeout. That
    # is also how a message a killed worker held comes back (a dispatch it had not
    # stored yet; a stored run is recovered sooner, by recover()). A task should
    # not outlive it, so the hard time limit sits below it (SPEC); a deployment
    # whose runs are short can lower both in celeryconfig.py. Workers look for
    # such messages every 10 s.
    visibility_timeout = 3600
    broker_url = s.effective_broker_url or "redis://localhost:6379/0"
    # RabbitMQ closes the channel of a delivery unacked for its consumer_timeout (30
    # min by default), and the worker ends ("Unrecoverable error: PreconditionFailed"),
    # every message it held given back: the limit sits below that there.
    unacked_for_at_most = _AMQP_CONSUMER_TIMEOUT if _is_amqp(broker_url) else visibility_timeout
    return {
        # The broker is the Redis that holds the leases unless AGENTRUNS_BROKER_URL says otherwise.
        "broker_url": broker_url,
        # A worker that starts before Redis keeps trying instead of exiting.
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {
            "visibility_timeout": visibility_timeout,
            "unacked_restore_interval": 10,
            "unacked_restore_throttle": 1,
        },
        # The hard limit only backstops a hung prefork child (the threads pool cannot
        # enforce limits): just before it, the execution settles its run interrupted
        # (tasks.py's soft limit), and ``recover`` resumes it. No soft limit of the
        # worker's: ``Budget.timeout_s`` bounds a run, and settles it cleanly.
        "task_time_limit": unacked_for_at_most - 600,
        # Ack after the task returns, and give a message back if the worker process
        # dies mid-task: a crash becomes a redelivery (a nudge), never a lost run.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        # One message per free pool slot: a worker never sits on messages others could run.
        "worker_prefetch_multiplier": 1,
        # When the broker connection drops, the runs in flight go on: their leases and
        # the database are elsewhere, and a copy of their message is only a nudge the
        # claim refuses. (Cancelling them killed a prefork pool's processes, as a crash
        # would, and logged a traceback per task in a threads pool, which cannot.)
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        # Results live in the database (runs and steps), not in a result backend.
        "task_ignore_result": True,
        # Several deployments (or test sessions) can share one Redis.
        "task_default_queue": s.queue,
        # Beat's sweeps have a queue of their own, which every worker also consumes:
        # behind a backlog of runs in the main queue they would wait for all of it
        # (and expire unrun), leaving drained and crashed runs unrecovered meanwhile.
        # Now a sweep waits only for the next free pool slot.
        **_queues(s.queue),
        "task_serializer": "json",
        "accept_content": ["json"],
        # Flower (and `celery events`) see every task from the moment it is sent.
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        # Celery's consumer, publishing those events in batches (agentruns.consumer).
        "worker_consumer": "agentruns.consumer:Consumer",
        # Beat's scheduler: Celery's, saying in one line a sweep it could not send.
        "beat_scheduler": "agentruns.beat:Scheduler",
        # Sweeps, safe when two beats run. `expires` drops a sweep no worker picked
        # up within a minute after the next one was due, so a backlog never piles
        # up. Celery stamps it with beat's clock and checks it with the worker's:
        # the minute keeps a clock a little off from dropping every sweep.
        "beat_schedule": {
            "agentruns.tick": {
                "task": "agentruns.tick",
                "schedule": s.tick_interval,
                "options": {"expires": s.tick_interval + CLOCK_SKEW_S},
            },
            "agentruns.recover": {
                "task": "agentruns.recover",
                "schedule": s.recover_interval,
                "options": {"expires": s.recover_interval + CLOCK_SKEW_S},
            },
        },
    }


def _celeryconfig() -> ModuleSpec | None:
    """The ``celeryconfig`` module, if there is one. Celery imports it with the
    working directory on the path; so do we."""
    with cwd_in_path():
        return importlib.util.find_spec("celeryconfig")


class AMQP(CeleryAMQP):  # type: ignore[misc]
    """Celery's AMQP, sending agentruns' tasks with message protocol 2 whatever
    ``task_protocol`` says (a deployment's other tasks keep it). Protocol 1 has no
    ``argsrepr``: its ``task-sent`` event, which Flower shows, would carry a
    trigger's payload and a resume token (``agentruns.tasks._Task``). Every worker
    since Celery 4 reads both protocols."""

    def create_task_message(self, task_id: str, name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("agentruns."):
            create = self.as_task_v2
        else:
            create = self.task_protocols[self.app.conf.task_protocol]
        return create(task_id, name, *args, **kwargs)


app = Celery("agentruns", include=["agentruns.tasks"], amqp=AMQP)
# Both are read lazily, when the configuration is first needed, not on import.
app.add_defaults(defaults)
if _celeryconfig() is not None:
    app.config_from_object("celeryconfig")


@app.on_after_configure.connect  # type: ignore[untyped-decorator]
def _configured(sender: Celery, **_: Any) -> None:
    conf = sender.conf
    _follow_default_queue(sender, _apply_celeryconfig(conf))
    _pick_transport(sender)
    _say_what_overrode_the_environment(conf)


def _say_what_overrode_the_environment(conf: Any) -> None:
    """Warn when the broker or queue that ``AGENTRUNS_*`` variables name is not the one
    this app uses: Celery's ``CELERY_BROKER_URL`` beats every app's ``broker_url``,
    and a ``celeryconfig`` module (a team's own, for its own app, in the working
    directory) has the last word. Either sends this app's messages where no
    agentruns worker may read them, and points its workers at another queue."""
    s = _settings()
    env = os.environ
    spec = _celeryconfig()
    module = f"celeryconfig ({spec.origin})" if spec is not None else "the configuration"
    named = "AGENTRUNS_BROKER_URL" if "AGENTRUNS_BROKER_URL" in env else "AGENTRUNS_REDIS_URL"
    by = "CELERY_BROKER_URL" if env.get("CELERY_BROKER_URL") else module
    if named in env and s.effective_broker_url and conf.broker_url != s.effective_broker_url:
        log.warning(
            "agentruns: the Celery broker is %s, set by %s, not %s from %s",
            maybe_sanitize_url(conf.broker_url),
            by,
            maybe_sanitize_url(s.effective_broker_url),
            named,
        )
    if "AGENTRUNS_QUEUE" in env and conf.task_default_queue != s.queue:
        log.warning(
            "agentruns: the Celery queue is %r, set by %s, not %r from AGENTRUNS_QUEUE",
            conf.task_default_queue,
            module,
            s.queue,
        )


def _follow_default_queue(sender: Celery, module_set: set[str]) -> None:
    """Workers consume the queue producers send to, and the sweeps are routed to a
    queue workers consume, whatever the deployment's celeryconfig set (new-style or
    old-style names): else every message would wait in a queue nobody reads. Where
    the deployment's own routes send a sweep, it goes there."""
    conf = sender.conf
    queue = conf.task_default_queue
    consumed = {q.name for q in conf.task_queues or ()}
    if queue not in consumed and not {"task_queues", "CELERY_QUEUES"} & module_set:
        conf.task_queues = _queues(queue)["task_queues"]
        consumed = {queue, sweeps_queue(queue)}
    sweeps = sweeps_queue(queue) if sweeps_queue(queue) in consumed else queue
    conf.task_routes = _route_sweeps(sender, sweeps)


def _route_sweeps(sender: Celery, queue: str) -> Any:
    """The ``task_routes`` that send beat's sweeps and cancels (``AHEAD``) where the
    deployment's own routes send them (an exact name, a glob such as ``agentruns.*``,
    a router), and to ``queue`` where none does. Routes to the sweeps queue of ``AGENTRUNS_QUEUE``
    are :func:`defaults`' own (also in a celeryconfig that starts from them), not
    the deployment's: they follow the default queue, as the queues do."""
    ours = _queues(_settings().queue)["task_routes"]
    routes = sender.conf.task_routes
    if isinstance(routes, dict):
        routes = {k: v for k, v in routes.items() if not (k in ours and v == ours[k])}
    theirs = Router(prepare(routes), app=sender)
    added = {}
    for task in AHEAD:
        try:
            routed = theirs.lookup_route(task, (), {}, {}) is not None
        except Exception:  # a router that fails here fails at the send too: ours go after it
            log.warning("agentruns: could not ask task_routes where %s goes", task, exc_info=True)
            routed = False
        if not routed:
            added[task] = {"queue": queue}
    if routes is None or isinstance(routes, dict):
        return {**(routes or {}), **added}
    if not added:  # a list of routers (or one) that routes both: the deployment's as is
        return routes
    # A list of routers (or one): ours come last, after every one of the deployment's.
    return [*(routes if isinstance(routes, list | tuple) else [routes]), added]


def _pick_transport(sender: Celery, **_: Any) -> None:
    """A Redis broker gets agentruns' Redis transport (``agentruns.broker``: the same
    transport, without a new Redis client per command), unless the configuration
    names a transport itself. Decided once the final configuration is known, so a
    ``celeryconfig.py`` that points ``broker_url`` elsewhere gets Celery's own."""
    conf = sender.conf
    if conf.broker_transport is None and isinstance(conf.broker_url, str):
        conf.broker_transport = transport_for(conf.broker_url)


def _apply_celeryconfig(conf: Any) -> set[str]:
    """Give the config module's settings the last word; return the names of those
    that differ from :func:`defaults` (a module that starts from them, as the
    repository's does, sets every one of ours). Celery ranks defaults added with
    ``add_defaults`` above its config module, so without this the module could not
    override any setting of :func:`defaults` (only add others). Its ``beat_schedule``
    is the one setting merged with ours, not put in its place."""
    if _celeryconfig() is None:
        return set()
    with cwd_in_path():
        module = importlib.import_module("celeryconfig")
    ours = defaults()
    changed = set()
    for name, value in vars(module).items():
        if name in conf and not name.startswith("_"):  # Celery's settings, not helpers
            conf[name] = value
            if name not in ours or ours[name] != value:
                changed.add(name)
    # A schedule of the module's own (either style of name) adds to beat's sweeps:
    # without them, crashed runs are never recovered and approvals never expire. An
    # entry of the same name replaces ours.
    conf.beat_schedule = {**ours["beat_schedule"], **(conf.beat_schedule or {})}
    return changed
