"""An agent module that cannot be imported: it opens a configuration file that is not
there (a deployment's mistake), so its import raises FileNotFoundError, an OSError like
those of an outage. Each try is logged (AGENTRUNS_TEST_LOG), as ``import broken_agents PID``."""

from __future__ import annotations

import os

from tests.support.celery_agents import log

log("import broken_agents")
with open(os.environ.get("AGENTRUNS_TEST_CONFIG", "/nonexistent/agentruns/agents.yaml")) as f:
    CONFIG = f.read()
