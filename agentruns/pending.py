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


def damaged(pending: Any) -> str | None:
    """What makes a stored map unreadable (edited by hand), or None: not an object,
    or an entry that is not an object with a status."""
    if pending is None:
        return None
    if not isinstance(pending, dict):
        return f"is not a valid object ({pending!r:.80})"
    for call_id, entry in pending.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("status"), str):
            return f"has an entry for {call_id} that is not a valid one ({entry!r:.80})"
    return None


def status(entry: Entry | None) -> str | None:
    return None if entry is None else str(entry["status"])


def unknown(entry: Entry | None) -> bool:
    """Is calling the tool again what is asked, or approved?"""
    return bool((entry or {}).get("unknown", False))
