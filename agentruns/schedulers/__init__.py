"""Schedulers: how an execution gets started (in-process threads, or Celery)."""

from agentruns.schedulers.base import Scheduler
from agentruns.schedulers.celery import CeleryScheduler
from agentruns.schedulers.local import LocalScheduler
from agentruns.schedulers.manual import ManualScheduler

__all__ = ["CeleryScheduler", "LocalScheduler", "ManualScheduler", "Scheduler"]
