"""Example agents a worker imports (``AGENTRUNS_AGENTS=workers.triage``)."""
