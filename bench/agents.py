"""The agents the Celery workers of figures 4 and 5 import (``AGENTRUNS_AGENTS=bench.agents``)."""

from __future__ import annotations

import os

from bench import workload

THROUGHPUT_STEPS = 5
THROUGHPUT_LATENCY_S = 0.2
THROUGHPUT_SECONDS_PER_RUN = THROUGHPUT_STEPS * THROUGHPUT_LATENCY_S
# Figure 5 kills a worker mid-run: a run long enough to still be going afterwards.
LONG_STEPS = 400
LONG_LATENCY_S = float(os.environ.get("AGENTRUNS_BENCH_LONG_LATENCY", "0.25"))

throughput = workload.agent("bench_throughput", THROUGHPUT_STEPS, THROUGHPUT_LATENCY_S)
# Figure 4b's control: the same second of model time per run in ONE step (one model
# call, no tool), so the engine does the least a run can: store, claim, one write.
one_step = workload.agent("bench_one_step", 1, THROUGHPUT_SECONDS_PER_RUN)
long_run = workload.agent("bench_long", LONG_STEPS, LONG_LATENCY_S)
