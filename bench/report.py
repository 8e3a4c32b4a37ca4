"""Figures, their targets, and the table (or JSON) they are printed as."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Figure:
    """One reported number; ``value`` is None when it could not be measured (see ``note``)."""

    id: str
    name: str
    unit: str
    value: float | None = None
    target: float | None = None
    # "max": the value must not exceed the target; "min": it must reach it.
    bound: str = "max"
    note: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def met(self) -> bool | None:
        if self.value is None or self.target is None:
            return None
        return self.value <= self.target if self.bound == "max" else self.value >= self.target

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "met": self.met}


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of the samples, for the JSON detail."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3f}" if abs(value) < 1 else f"{value:.2f}"


def table(figures: list[Figure]) -> str:
    rows = [("#", "figure", "value", "target", "met")]
    for f in figures:
        value = f"{_fmt(f.value)} {f.unit}" if f.value is not None else f"not measured: {f.note}"
        target = "-" if f.target is None else f"{'≤' if f.bound == 'max' else '≥'} {_fmt(f.target)}"
        met = {True: "yes", False: "NO", None: "-"}[f.met]
        rows.append((f.id, f.name, value, target, met))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    notes = [f"  {f.id}: {f.note}" for f in figures if f.value is not None and f.note]
    if notes:
        lines += ["", "notes:", *notes]
    return "\n".join(lines)
