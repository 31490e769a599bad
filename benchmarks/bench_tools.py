"""Tools for benchmarks only (benchmarks/tool_episodes.py): the calculator with a latency."""

from __future__ import annotations

import math
import statistics
import time
import zlib

from operators.environments.environment import calculator

MEDIAN_S, SIGMA, CAP_S = 0.2, 1.0, 2.0


def latency(expression: str) -> float:
    """Seconds a call waits: lognormal (median MEDIAN_S, sigma SIGMA), capped at CAP_S, drawn from the
    expression's hash, so every run (and both modes of a benchmark) waits the same for the same call."""
    u = (zlib.crc32(expression.encode()) % 1_000_003 + 0.5) / 1_000_003  # (0, 1)
    z = statistics.NormalDist().inv_cdf(u)
    return min(CAP_S, MEDIAN_S * math.exp(SIGMA * z))


def slow_calculator(expression: str) -> str:
    time.sleep(latency(expression))
    return calculator(expression)

