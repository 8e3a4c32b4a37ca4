"""Celery settings for agentruns workers, beat and producers (read by ``agentruns.celery``).

They start from agentruns' own, built from ``AGENTRUNS_*`` settings; read
``agentruns.celery.defaults`` for each one and why it is what it is
(at-least-once delivery: the claim, not the broker, decides who runs a run).
Set any Celery setting below them to override it for this deployment.
"""

from __future__ import annotations

from agentruns.celery import defaults

globals().update(defaults())

# Overrides for this deployment go here, e.g.:
# worker_max_tasks_per_child = 1000
