"""One CLI invocation: its settings, its engine (opened on first use) and its output."""

from __future__ import annotations

import logging
import sys
import threading
import warnings
from typing import Any, TextIO

import redis

from agentruns.agent import Agent
from agentruns.cli import render
from agentruns.cli.errors import CliError
from agentruns.engine import Engine
from agentruns.errors import AgentrunsError, NotifierError, first_line
from agentruns.events import Event
from agentruns.leases import LocalLeases
from agentruns.schedulers import LocalScheduler
from agentruns.settings import Settings, is_redis_url, read_settings
from agentruns.store.connect import is_sqlite_memory, shown_url
from agentruns.wiring import engine_from_settings, load_agents

log = logging.getLogger("agentruns")

# How long a command waits for the notifier calls of the runs it started or ticked.
NOTIFIERS_WAIT_S = 10.0


class Session:
    def __init__(self, as_json: bool, out: TextIO | None = None) -> None:
        self.as_json = as_json
        self.out = out or sys.stdout
        self._settings: Settings | None = None
        self._engine: Engine | None = None
        self.reported: list[Exception] = []
        self._said: list[Exception] = []  # of those reported: warned of
        self.shown: dict[str, str] = {}  # run id -> the status last printed by follow()
        self._print_lock = threading.Lock()
        self._notifiers_left = False  # a notifier call outlived NOTIFIERS_WAIT_S (see _wait)

    # -- output ---------------------------------------------------------------

    def say(self, text: str = "") -> None:
        """A line for people; nothing in ``--json`` mode."""
        if not self.as_json:
            self.emit(text)

    def emit(self, text: str) -> None:
        with self._print_lock:
            print(text, file=self.out, flush=True)

    def json(self, value: Any) -> None:
        if self.as_json:
            self.emit(render.as_json(value))

    # -- configuration ---------------------------------------------------------

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = read_settings()
        return self._settings

    def settings_or_none(self) -> Settings | None:
        """The settings if they can be read (for describing an error that may be about them)."""
        try:
            return self.settings
        except Exception:
            return None

    @property
    def embedded(self) -> bool:
        """No Redis configured: executions happen in this process, on the in-process scheduler."""
        return not self.settings.redis_url

    def engine(self, *, read_only: bool = False) -> Engine:
        """The engine of ``AGENTRUNS_*``; ``read_only`` commands leave Redis out of it."""
        if self._engine is None:
            self.refuse_sqlite_memory()  # a missing file: the store's schema check says so
            settings = self.settings
            overrides: dict[str, Any] = {}
            if read_only:  # reading runs needs neither Redis nor the agents' code
                settings = settings.model_copy(update={"agents": ""})
                overrides = {"leases": LocalLeases(), "scheduler": LocalScheduler()}
            else:
                overrides = {"agents": self._agents()}
                self._check_redis()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "no secret": said where it matters
                self._engine = engine_from_settings(
                    settings, on_error=self.reported.append, **overrides
                )
        return self._engine

    def _agents(self) -> list[Agent]:
        try:
            return load_agents(self.settings.agent_modules)
        except AgentrunsError as exc:  # they do not import, or cannot be used together
            raise CliError(str(exc)) from None

    def refuse_sqlite_memory(self) -> None:
        """An in-memory SQLite database ends with the command: migrated by one, it
        was gone for the next, which said to migrate it."""
        if is_sqlite_memory(self.settings.database_url):
            raise CliError(
                f"{self.settings.database_url} is an in-memory database, gone when this"
                " command ends: give the CLI a file, e.g. sqlite:///agentruns.db"
                " (AGENTRUNS_DATABASE_URL)"
            )

    def _check_redis(self) -> None:
        """Fail in one line, before anything is written, if Redis or the broker is down."""
        if self.embedded:
            return
        urls = {
            "AGENTRUNS_REDIS_URL": self.settings.redis_url,
            "AGENTRUNS_BROKER_URL": self.settings.broker_url,
        }
        for name, url in urls.items():
            if not is_redis_url(url):
                continue
            client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
            try:
                client.ping()
            except redis.RedisError as exc:
                raise CliError(f"cannot reach Redis at {shown_url(url)} ({name}): {exc}") from None
            finally:
                client.close()

    # -- executions in this process ------------------------------------------------

    def follow(self) -> None:
        """Print steps and status changes as they happen in this process (embedded mode)."""
        if self.as_json or not self.embedded:
            return
        engine = self.engine()
        last = self.shown

        def on_step(event: Event) -> None:
            if event.step is not None:
                self.emit("  " + render.step_line(event.step))

        def on_run(event: Event) -> None:
            run = event.run
            if run is not None and last.get(run.id) != run.status.value:
                last[run.id] = run.status.value
                self.emit("  " + render.run_line(run))

        engine.on("step.appended", on_step)
        engine.on("run.updated", on_run)

    def settle(self, *, warn_notifiers: bool = True) -> None:
        """Wait for the executions this process started (embedded mode) to finish or
        pause; one the database or Redis stopped is this command's failure, and a
        notifier that failed is warned of (unless the command says so itself)."""
        if self._engine is not None:
            self._wait(self._engine)
        self.raise_reported()
        for exc in self.reported if warn_notifiers else ():
            if isinstance(exc, NotifierError) and exc not in self._said:
                # Else silent: the run waits, nobody told, and the command says nothing.
                self._said.append(exc)
                log.warning("%s (`agentruns tick` calls it again)", first_line(exc, typed=False))

    def _wait(self, engine: Engine) -> None:
        """Until the executions this process started finished or paused, and the
        notifier calls they (or tick) asked for returned: those NOTIFIERS_WAIT_S at
        most. A notifier that hangs (a webhook with no timeout) hung the command for
        ever, and `agentruns tick` from cron piled up; its call is left under way, and
        its run is not marked notified, so the next tick calls it again."""
        while True:
            engine.idle(notifiers=False)
            if engine.idle(NOTIFIERS_WAIT_S):
                return
            if engine.idle(0, notifiers=False):
                break  # only notifier calls are left (else one started a run: wait for it)
        self._notifiers_left = True
        log.warning(
            "a notifier call has not returned after %gs: left under way, its run not marked"
            " notified (`agentruns tick` calls it again); give your webhook calls a timeout",
            NOTIFIERS_WAIT_S,
        )

    def raise_reported(self) -> None:
        """An infrastructure failure an engine swallowed and reported is this command's failure."""
        for exc in self.reported:
            if Engine.is_infrastructure_error(exc) or isinstance(exc, redis.RedisError):
                raise exc

    def close(self, *, interrupted: bool = False) -> None:
        """Close the engine (draining its executions). A Ctrl-C does not wait for the
        notifier calls under way either: it waited for them another 10 s, after its
        person asked to stop. Those left are called again by the next tick."""
        if self._engine is not None:
            engine, self._engine = self._engine, None
            if self._notifiers_left or interrupted:  # waited for, and said; or not wanted
                engine.close(notifiers_timeout=0)
            else:
                engine.close()
