"""The store: runs, steps, messages and effect records."""

from agentruns.store.base import Store
from agentruns.store.sql import SqlStore

__all__ = ["SqlStore", "Store"]
