"""An example bug-triage agent: find duplicates, label the issue, comment (after approval).

The tracker is a fake kept in memory, so the agent runs anywhere. With
``ANTHROPIC_API_KEY`` set it thinks with Claude; without it, a ``ScriptedModel``
plays the same conversation every time, with no network.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from datetime import timedelta
from typing import Any

from agentruns import Agent, Budget, Run, ToolContext, Usage, WaitPoint, tool
from agentruns.models import Model, ScriptedModel, text, tool_use

log = logging.getLogger(__name__)

INSTRUCTIONS = """\
You triage bug reports for the Acme app. For the report you are given:
1. search the tracker for duplicates with search_issues;
2. post one short, friendly comment on the report with post_comment, linking a
   duplicate if you found one;
3. label the report with label_issue ("bug", plus "duplicate" when it is one);
4. answer with one sentence saying what you did."""


# -- the fake tracker ----------------------------------------------------------------

ISSUES: dict[str, dict[str, Any]] = {
    "ACME-97": {
        "title": "Crash on start after upgrading to 2.3",
        "state": "open",
        "labels": ["bug", "crash"],
    },
    "ACME-113": {"title": "Settings page is slow to load", "state": "open", "labels": ["perf"]},
    "ACME-120": {"title": "Dark mode ignores system setting", "state": "closed", "labels": []},
}
COMMENTS: dict[str, dict[str, Any]] = {}  # idempotency key -> comment
_lock = threading.Lock()


def _words(value: str) -> set[str]:
    return {w.strip(".,:;!?\"'()").lower() for w in value.split() if len(w) > 2}


@tool
def search_issues(query: str, limit: int = 5) -> list[dict[str, Any]]:
    """Search the issue tracker; returns the best matches with id, title, state and labels."""
    wanted = _words(query)
    scored = [(len(wanted & _words(issue["title"])), key, issue) for key, issue in ISSUES.items()]
    hits = sorted((s for s in scored if s[0] > 0), key=lambda s: (-s[0], s[1]))
    return [{"id": key, **issue} for _, key, issue in hits[:limit]]


@tool
def label_issue(issue: str, labels: list[str]) -> dict[str, Any]:
    """Add labels to an issue; returns its labels afterwards."""
    with _lock:
        entry = ISSUES.setdefault(issue, {"title": "", "state": "open", "labels": []})
        entry["labels"] = sorted({*entry["labels"], *labels})
        return {"id": issue, "labels": entry["labels"]}


@tool(effect=True, needs_approval=True)
def post_comment(issue: str, body: str, ctx: ToolContext) -> dict[str, Any]:
    """Post a comment on an issue (a person approves it first)."""
    with _lock:
        # The tracker deduplicates on the idempotency key, as a real API's
        # Idempotency-Key header would: a retried call posts nothing new.
        comment = COMMENTS.setdefault(
            ctx.idempotency_key,
            {"id": f"c{len(COMMENTS) + 1}", "issue": issue, "body": body},
        )
    return {"comment_id": comment["id"], "issue": issue, "url": f"https://tracker.example/{issue}"}


def notify(run: Run, wait: WaitPoint, token: str) -> None:
    """Where a real deployment would page a person (Slack, email) with the token. The
    token is a credential: it goes to that person, never into a log, which says how
    an operator who holds the secret can answer instead."""
    log.info(
        "run %s waits for approval of %s(%s): agentruns approve --run %s",
        run.id,
        wait.tool_name,
        json.dumps(wait.input),
        run.id,
    )


# -- the model -----------------------------------------------------------------------


def _report(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The trigger payload from the run's first message (see SPEC §4, step 2)."""
    try:
        payload = json.loads(messages[0]["content"]).get("payload")
    except (KeyError, IndexError, TypeError, ValueError):
        payload = None
    return payload if isinstance(payload, dict) else {}


def script(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The conversation a careful triager would have, as one response per turn."""
    report = _report(messages)
    issue = str(report.get("issue", "ACME-142"))
    title = str(report.get("title", "App crashes on start"))
    turn = sum(1 for m in messages if m.get("role") == "assistant")
    steps = [
        tool_use("search_issues", {"query": title, "limit": 3}),
        tool_use(
            "post_comment",
            {
                "issue": issue,
                "body": "Thanks for the report! This looks like ACME-97 (crash on start "
                "after upgrading to 2.3); we are tracking the fix there.",
            },
        ),
        tool_use("label_issue", {"issue": issue, "labels": ["bug", "duplicate"]}),
        text(f"Triaged {issue}: duplicate of ACME-97, commented and labelled bug + duplicate."),
    ]
    return steps[min(turn, len(steps) - 1)]


SCRIPT_LENGTH = 4  # model calls in the scripted conversation


def scripted_model(latency_s: float = 0.0) -> ScriptedModel:
    # A worker serves this model for its whole life: it keeps no transcripts.
    return ScriptedModel(
        script,
        usage=Usage(input_tokens=420, output_tokens=60),
        latency_s=latency_s,
        keep_calls=False,
    )


def default_model() -> Model:
    if os.environ.get("ANTHROPIC_API_KEY"):
        from agentruns.models import AnthropicModel

        model: Model = AnthropicModel("claude-sonnet-4-5")
        return model
    return scripted_model()


def make_agent(model: Model | None = None) -> Agent:
    """The triage agent with another model (the demo uses a slow scripted one)."""
    return Agent(
        name="triage",
        model=model or default_model(),
        instructions=INSTRUCTIONS,
        tools=[search_issues, label_issue, post_comment],
        budget=Budget(max_steps=12, max_tokens=200_000, timeout_s=300),
        approval_ttl=timedelta(hours=24),
        notifier=notify,
        # One triage at a time per issue: a second report for it waits its turn.
        concurrency_key=lambda trigger: trigger.keys.get("issue"),
    )


triage = make_agent()
