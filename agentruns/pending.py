"""A step's calls while it is paused on approvals: the run's ``pending`` map.

The map is kept by tool call id, in the run's row, from the pause until the step's
results are saved (then it is cleared). An entry is one of:

- ``{"status": "done", "content": ..., "is_error": ...}``: the call's result, from
  the tool, or a denial;
- ``{"status": "needs_approval", "wait": {...}}``: waiting for a person's answer
  (``wait`` is the wait point announced, kept so a re-pause keeps its token);
- ``{"status": "approved"}``: approved, to run in the next execution;

with ``"unknown": true`` when what is asked (or approved) is calling an effect tool
again whose first attempt may have happened before a crash. Rows written by
earlier releases have the same shape: it is read as stored.
"""

from __future__ import annotations

from typing import Any

Entry = dict[str, Any]

DONE = "done"
NEEDS_APPROVAL = "needs_approval"
APPROVED = "approved"


def done(content: Any, is_error: bool) -> Entry:
    return {"status": DONE, "content": content, "is_error": is_error}


def needs_approval(unknown: bool) -> Entry:
    entry: Entry = {"status": NEEDS_APPROVAL}
    if unknown:
        entry["unknown"] = True
    return entry


def approved(unknown: bool) -> Entry:
    return {"status": APPROVED, "unknown": unknown}


def status(entry: Entry | None) -> str | None:
    return None if entry is None else str(entry["status"])


def unknown(entry: Entry | None) -> bool:
    """Is calling the tool again what is asked, or approved?"""
    return bool((entry or {}).get("unknown", False))
