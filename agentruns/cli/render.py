"""How runs and steps look on a terminal: one-line summaries, tables and the timeline."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from agentruns.runs import Run, RunStatus, Step, utcnow

BAR_WIDTH = 24

# C0 and C1 controls (ESC, CR, BEL, newlines ...), DEL, line and paragraph separators,
# and the marks that reorder text: what would move, recolour or retitle a terminal.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def plain(text: str) -> str:
    """``text`` with its control characters escaped (ESC as ``\\x1b``): a line shows
    what a model, a tool or a trigger wrote, and they must not drive the terminal
    (or start a line that looks like one of ours)."""
    return _CONTROL.sub(lambda m: ascii(m.group())[1:-1], text)


def duration(seconds: float) -> str:
    """``12ms``, ``1.24s``, ``3m05s``, ``2h10m``, ``3d04h``."""
    seconds = max(seconds, 0.0)
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.2f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def clock(at: datetime | None, *, date: bool = False) -> str:
    if at is None:
        return "-"
    local = at.astimezone()
    return local.strftime("%Y-%m-%d %H:%M:%S" if date else "%H:%M:%S")


def short(value: Any, width: int = 60) -> str:
    """A value as compact one-line JSON (strings as they are), cut to ``width``."""
    body = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    body = plain(" ".join(body.split()))
    return body if len(body) <= width else body[: width - 3] + "..."


def answer_by_run(run: Run) -> str:
    """The command that answers a waiting run by its id, pinned to its approval: given
    after another operator answered that one, it is refused, not taken for the run's
    next approval, which its operator has not seen."""
    pinned = f" --approval {run.waiting.approval_id}" if run.waiting is not None else ""
    return f"agentruns approve --run {run.id}{pinned}  (or deny)"


def tokens(run: Run) -> str:
    return used_tokens(run.usage.model_dump())


def used_tokens(usage: dict[str, Any]) -> str:
    """Tokens in and out; the input counts what the model read from its cache and
    wrote to it (as a budget does: Anthropic's ``input_tokens`` leaves both out)."""

    def count(name: str) -> int:
        value = usage.get(name)
        return value if isinstance(value, int) else 0

    read, written = count("cache_read_input_tokens"), count("cache_creation_input_tokens")
    cached = [f"{read} cache read"] * bool(read) + [f"{written} cache write"] * bool(written)
    into = count("input_tokens") + read + written
    note = f" ({', '.join(cached)})" if cached else ""
    return f"{into} in{note} / {count('output_tokens')} out"


def table(rows: Sequence[Sequence[str]], headers: Sequence[str]) -> str:
    rows = [[plain(cell) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def runs_table(runs: Sequence[Run]) -> str:
    if not runs:
        return "no runs"
    rows = [
        [
            r.id,
            r.agent,
            r.status.value,
            str(r.steps_used),
            str(r.usage.total_tokens),
            clock(r.created_at, date=True),
            duration(((r.finished_at or utcnow()) - r.created_at).total_seconds()),
        ]
        for r in runs
    ]
    return table(rows, ["id", "agent", "status", "model steps", "tokens", "created", "age/took"])


def step_detail(step: Step) -> str:
    """What a step did, in a few words."""
    if step.error:
        error = step.error if isinstance(step.error, dict) else {"message": step.error}
        return f"error {error.get('code', '')}: {short(error.get('message', ''), 70)}".strip()
    out = step.output if isinstance(step.output, dict) else {}
    if step.kind == "llm":
        calls = [c.get("name", "?") for c in out.get("tool_calls", [])]
        usage = out.get("usage") or {}
        used = f"  ({used_tokens(usage)})"
        said = f"-> {', '.join(calls)}" if calls else f'"{short(out.get("text", ""), 56)}"'
        return said + used
    if step.kind == "wait":
        verdict = "approved" if out.get("approved") else "denied"
        reason = out.get("reason")
        return f"{verdict}{f': {reason}' if reason else ''}"
    return f"{short(step.input, 40)} -> {short(step.output, 40)}"


def step_line(step: Step) -> str:
    took = duration((step.finished_at - step.started_at).total_seconds())
    name = step.name or ""
    return plain(f"step {step.index:<3} {step.kind:<4} {name:<14} {took:>7}  {step_detail(step)}")


def run_line(run: Run) -> str:
    """The run's status in one line, with what matters for that status."""
    text = f"run {run.id} {run.status.value}"
    if run.waiting is not None:
        text += f" on approval of {run.waiting.tool_name}({short(run.waiting.input, 60)})"
    if run.error is not None:
        text += f": {run.error.code}: {run.error.message}"
    if run.status.value == "completed" and run.output:
        text += f': "{short(run.output, 70)}"'
    if run.cancel_requested and not run.status.is_final:
        text += " (cancel requested)"
    return plain(text)


def header(
    run: Run,
    losses: int = 0,
    held_until: datetime | None = None,
    went_on: str | None = None,
) -> str:
    """The run's fields, one a line; ``losses``: its executions lost with their
    workers in a row at its step (``Store.losses``), ``held_until``: when recover
    may requeue it, lost again (``Engine.hold``), and ``went_on``: the run of its
    thread that went on without it, failed (which a retry is refused for)."""
    end = run.finished_at or utcnow()
    age = duration((end - run.created_at).total_seconds())
    trigger = run.trigger
    keys = " ".join(f"{k}={v}" for k, v in trigger.keys.items())
    lines = [
        f"run       {run.id}",
        f"agent     {run.agent}",
        f"status    {run.status.value}"
        + ("  (cancel requested)" if run.cancel_requested and not run.status.is_final else ""),
        f"trigger   {trigger.source} / {trigger.trigger}{f'  keys: {keys}' if keys else ''}",
        f"payload   {short(trigger.payload, 80)}",
        f"created   {clock(run.created_at, date=True)}   "
        f"{'took' if run.finished_at else 'age'} {age}",
        f"usage     {run.steps_used} model steps, {tokens(run)} tokens",
    ]
    if run.thread:
        lines.append(f"thread    {run.thread}")
    if run.concurrency_key:
        lines.append(f"key       {run.concurrency_key}")
    if run.waiting is not None:
        wait = run.waiting
        lines.append(f"waiting   {wait.tool_name}({short(wait.input, 60)})")
        lines.append(f"          expires {clock(wait.expires_at, date=True)}")
        lines.append(f"          answer: {answer_by_run(run)}")
    if run.claim is not None:
        line = f"claim     {run.claim.owner} until {clock(run.claim.expires_at)}"
        if run.status is RunStatus.RUNNING and run.claim.expires_at < utcnow():
            # Not renewed: its worker died or let it go; it is not running anywhere.
            line += " (expired: `agentruns recover` requeues it"
            if held_until is not None and held_until > utcnow():
                same_day = held_until.astimezone().date() == utcnow().astimezone().date()
                line += f" once its hold ends, at {clock(held_until, date=not same_day)}"
            line += ")"
        lines.append(line)
    if losses:
        lines.append(
            f"losses    {losses} in a row at its step, each with its worker: recover holds it"
            " back longer each time (`agentruns cancel` it if its step kills workers)"
        )
    if run.output:
        lines.append(f"output    {short(run.output, 100)}")
    if run.error is not None:
        lines.append(f"error     {run.error.code}: {run.error.message}")
    if run.status is RunStatus.FAILED and went_on is not None:
        lines.append(
            f"          not retried: run {went_on} of its thread went on without it;"
            " dispatch to the thread again"
        )
    elif run.status is RunStatus.FAILED:
        lines.append(
            f"          retry: agentruns retry {run.id}{_raised(run)}  (from its latest checkpoint)"
        )
    return "\n".join(plain(line) for line in lines)


def _raised(run: Run) -> str:
    """The ``--budget`` a retry of a run failed on its budget needs to go on."""
    budget = run.budget
    code = run.error.code if run.error is not None else None
    # Twice the limit, or what the run used if more (a limit a retry set below it),
    # and room for a few more steps past a small one (1 step: 2 was one call more).
    if code == "step_budget_exceeded":
        steps = max(budget.max_steps if budget is not None else 0, run.steps_used)
        return f" --budget '{{\"max_steps\": {max(2 * steps, steps + 10)}}}'"
    if code == "token_budget_exceeded":
        tokens = max((budget.max_tokens or 0) if budget is not None else 0, run.usage.total_tokens)
        return f" --budget '{{\"max_tokens\": {max(2 * tokens, tokens + 10_000)}}}'"
    return ""


def timeline(run: Run, steps: Sequence[Step]) -> str:
    """Steps against the run's wall clock: offset from creation, duration and a bar."""
    if not steps:
        return "no steps yet"
    start = run.created_at
    end = max([s.finished_at for s in steps] + [run.finished_at or steps[-1].finished_at])
    span = max((end - start).total_seconds(), 1e-6)
    rows = []
    for step in steps:
        offset = (step.started_at - start).total_seconds()
        took = (step.finished_at - step.started_at).total_seconds()
        first = min(int(offset / span * BAR_WIDTH), BAR_WIDTH - 1)
        length = max(1, round(took / span * BAR_WIDTH))
        bar = "." * first + "#" * min(length, BAR_WIDTH - first)
        rows.append(
            [
                str(step.index),
                f"+{duration(offset)}",
                duration(took),
                step.kind,
                step.name or "",
                f"|{bar.ljust(BAR_WIDTH, '.')}|",
                step_detail(step),
            ]
        )
    return table(rows, ["#", "at", "took", "kind", "name", "timeline", "what"])


def as_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


def run_json(run: Run, steps: Sequence[Step] | None = None) -> dict[str, Any]:
    data: dict[str, Any] = run.model_dump(mode="json")
    if steps is not None:
        data["steps"] = [s.model_dump(mode="json") for s in steps]
    return data
