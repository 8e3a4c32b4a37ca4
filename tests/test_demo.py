"""``agentruns demo`` end to end, as ``make demo`` runs it: a real child process is killed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _demo(*argv: str) -> tuple[subprocess.CompletedProcess[str], float]:
    script = Path(sys.executable).parent / "agentruns"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "agentruns.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTRUNS_")}
    env.pop("ANTHROPIC_API_KEY", None)  # the scripted model: no network
    started = time.monotonic()
    result = subprocess.run(
        [*command, *argv, "demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=90
    )
    return result, time.monotonic() - started


def test_the_demo_shows_approval_crash_and_recovery_in_order() -> None:
    result, took = _demo()
    out = result.stdout
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert took < 45

    milestones = [
        "== 1. dispatch",
        " queued",
        "step 0   llm",
        "waiting on approval of post_comment",
        "resume token (signed, expires, single use):",
        "wait post_comment",
        "engine.resume(token, approved=True)",
        "the same token again is refused: stale",
        "== 3. crash",
        "tool post_comment",
        "CRASH: kill -9",
        "the store still says running",
        "engine.recover() requeued",
        "completed:",
        "== 5. completed",
        "check: 4 model steps for a script of 4 responses",
        "check: step indexes 0..7, dense, none repeated",
        "check: post_comment ran 1 time",
        "== timeline",
        "usage     4 model steps, 1680 in / 240 out tokens",
    ]
    positions = [out.find(m) for m in milestones]
    missing = [m for m, p in zip(milestones, positions, strict=True) if p < 0]
    assert not missing, out
    assert positions == sorted(positions), out

    lines = out.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("#  ")) + 1 :]
    rows = [line.split() for line in table if line[:1].isdigit()]
    assert [r[0] for r in rows] == [str(i) for i in range(8)]
    assert [r[3] for r in rows] == ["llm", "tool", "llm", "wait", "tool", "llm", "tool", "llm"]


def test_the_demo_summary_in_json() -> None:
    result, _ = _demo("--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["checks"] == {
        "llm_steps": 4,
        "script_length": 4,
        "dense_indexes": True,
        "post_comment_runs": 1,
    }
    assert summary["crashed_at_step"] == 6
    assert summary["run"]["status"] == "completed"
    assert len(summary["run"]["steps"]) == 8
