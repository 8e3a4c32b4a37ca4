"""Celery settings for agentruns workers, beat and producers (read by ``agentruns.celery``).

Every message is an at-least-once nudge: the run's claim (a Redis lease plus
an epoch in Postgres) decides who executes it, so a duplicate, a redelivery
or a lost message is harmless. The settings below lean on that: they prefer
delivering a message twice to losing it, and they never hold a run inside the
broker (no ETA or countdown), because ``recover`` finds anything a lost
message leaves behind.

Values come from ``AGENTRUNS_*`` settings (see ``agentruns.settings``).
``AGENTRUNS_QUEUE`` (settings.queue) names the queue, so that several deployments (or test
sessions) can share one Redis.
"""

from __future__ import annotations

from typing import Any

from agentruns.settings import get_settings

_settings = get_settings()

# The broker is the Redis that holds the leases unless AGENTRUNS_BROKER_URL says otherwise.
broker_url = _settings.effective_broker_url or "redis://localhost:6379/0"
# A worker that starts before Redis keeps trying instead of exiting.
broker_connection_retry_on_startup = True

# Redis redelivers a message nobody acked within the visibility timeout. A
# redelivery is harmless (the claim decides), but a task should never outlive
# it in normal operation, so the hard time limit sits below it.
VISIBILITY_TIMEOUT_S = 3600
broker_transport_options: dict[str, Any] = {"visibility_timeout": VISIBILITY_TIMEOUT_S}
# The hard limit only backstops a hung prefork child (the threads pool cannot
# enforce limits). It kills the process; the lease then expires and
# ``recover`` resumes the run from its checkpoint. There is deliberately no
# soft limit: it would raise inside the engine at an arbitrary point and fail
# the run; ``Budget.timeout_s`` is the per-execution limit that settles cleanly.
task_time_limit = VISIBILITY_TIMEOUT_S - 600

# Ack after the task returns, and give a message back if the worker process dies
# mid-task: a crash becomes a redelivery (a nudge), never a lost run.
task_acks_late = True
task_reject_on_worker_lost = True
# One message per free pool slot: a worker never sits on messages other workers
# could run now.
worker_prefetch_multiplier = 1
# When the broker connection drops, the worker's unacked messages go back to the
# queue and will be delivered again; cancel the tasks they started rather than let
# them finish unacked beside their redelivered copies (harmless, but wasted work).
worker_cancel_long_running_tasks_on_connection_loss = True

# Results live in Postgres (runs and steps), not in a Celery result backend.
task_ignore_result = True

task_default_queue = _settings.queue

task_serializer = "json"
accept_content = ["json"]

# Flower (and `celery events`) see every task from the moment it is sent.
worker_send_task_events = True
task_send_sent_event = True

# Sweeps, safe when two beats run. `expires` drops a sweep no worker picked up
# before the next one was due, so a backlog never piles up behind a busy queue.
beat_schedule: dict[str, dict[str, Any]] = {
    "agentruns.tick": {
        "task": "agentruns.tick",
        "schedule": _settings.tick_interval,
        "options": {"expires": _settings.tick_interval},
    },
    "agentruns.recover": {
        "task": "agentruns.recover",
        "schedule": _settings.recover_interval,
        "options": {"expires": _settings.recover_interval},
    },
}
