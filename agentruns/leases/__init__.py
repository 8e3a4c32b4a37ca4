"""Leases: who may execute a run right now, and how to ask its holder to abort."""

from agentruns.leases.base import Leases
from agentruns.leases.local import LocalLeases
from agentruns.leases.redis import RedisLeases

__all__ = ["Leases", "LocalLeases", "RedisLeases"]
