"""Reading a run's transcript: its own messages after those of the runs it continues.

A run in a thread starts where the thread's previous completed run ended: its
``base_key`` names that run and ``base_count`` how many messages the transcript
holds there; the run's own messages are numbered on from ``base_count``. That
run may continue another, and so on back to the thread's first run. Nothing is
copied, so what a run writes never grows with its thread's history.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

# Each run of the chain gives its messages from its own first one (lo) up to
# where the run after it begins (hi). UNION, not UNION ALL: a cycle in damaged
# data repeats a row and so ends the recursion instead of looping.
_CHAIN_SQL = """
WITH RECURSIVE chain(run_key, base_key, lo, hi) AS (
    SELECT r.key, r.base_key, COALESCE(r.base_count, 0), CAST(:upto AS INTEGER)
    FROM agentruns_runs AS r WHERE r.key = :run_key
    UNION
    SELECT p.key, p.base_key, COALESCE(p.base_count, 0), c.lo
    FROM agentruns_runs AS p JOIN chain AS c ON p.key = c.base_key
)
SELECT m.body FROM chain AS c
JOIN agentruns_messages AS m ON m.run_key = c.run_key AND m.seq >= c.lo AND m.seq < c.hi
ORDER BY m.seq
"""

_CHAIN = sa.text(_CHAIN_SQL).columns(sa.column("body", sa.JSON))


def messages(conn: Connection, run_key: int, upto: int) -> list[dict[str, Any]]:
    """The first ``upto`` messages of the run's transcript, its base's included."""
    if upto <= 0:
        return []
    return list(conn.execute(_CHAIN, {"run_key": run_key, "upto": upto}).scalars())
