"""The workload of every figure (SPEC §11): S model steps, one 200-character tool call each.

Every step but the last calls ``echo`` once; the last answers with text. The
model is a ``ScriptedModel``, at zero latency unless a figure says otherwise.
"""

from __future__ import annotations

from typing import Any

from agentruns import Agent, Budget, Engine, RunStatus, Usage, tool
from agentruns.models import ScriptedModel, text, tool_use

TOOL_INPUT = "x" * 200


@tool
def echo(text: str) -> str:
    """Acknowledge a text."""
    return f"echoed {len(text)} characters"


def script(steps: int) -> list[dict[str, Any]]:
    return [tool_use("echo", {"text": TOOL_INPUT})] * (steps - 1) + [text("Done.")]


def agent(name: str, steps: int, latency_s: float = 0.0) -> Agent:
    return Agent(
        name,
        # Without keep_calls, a worker would hold every transcript of the benchmark
        # (and collect garbage through them): instrumentation a real model has not.
        ScriptedModel(
            script(steps),
            usage=Usage(input_tokens=10, output_tokens=5),
            latency_s=latency_s,
            keep_calls=False,
        ),
        instructions="Echo the text you are given.",
        tools=[echo],
        budget=Budget(max_steps=steps + 5),
    )


def trigger(n: int) -> dict[str, Any]:
    return {"source": "bench", "trigger": "bench", "payload": {"n": n}}


def check_completed(engine: Engine, run_id: str, steps: int) -> None:
    """A benchmark of a run that did not do the whole workload measures nothing."""
    run = engine.get_run(run_id)
    if run.status is not RunStatus.COMPLETED or run.steps_used != steps:
        raise RuntimeError(
            f"run {run_id} ended {run.status.value} after {run.steps_used} of {steps} steps: "
            f"{run.error}"
        )
