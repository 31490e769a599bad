"""The terms of the simulation's step-time inequalities, shared by the bound (benchmarks/sim_bound.py, where
they are derived) and the estimate without foresight (benchmarks/sim_tiers.py)."""

from __future__ import annotations

import numpy as np

from benchmarks.sim_cost import CostModel


def train_step_s(cost: CostModel, trained_tokens: float, train_gpus: int) -> float:
    """t: one train step of `trained_tokens` on `train_gpus` (sim_trainer's sleep)."""
    return cost.train_seconds_per_token * trained_tokens / train_gpus + cost.train_step_fixed_s


def layout_terms(tail: np.ndarray, work: np.ndarray, t: float, cost: CostModel, gen_gpus: int, staleness: int,
                 colocated: bool) -> dict[str, np.ndarray]:
    """The terms on one layout (sim_bound.py's docstring derives them), for decodes whose longest response
    takes `tail` seconds and whose tokens take `work` instance-seconds (arrays: one entry per way of
    decoding; the bound's is Lmax x tick(1) and full batches, sim_tiers.py's a batch by age); `t` the
    train step. The step can be no shorter than the largest."""
    instances = gen_gpus // cost.gpus_per_instance
    generation = np.maximum(tail, work / instances)  # gen: the step's first token to its last, at best
    terms = {"staleness chain": (cost.weight_sync_s + generation + t) / (staleness + 1),
             "trainer": np.full_like(tail, t, dtype=np.float64)}
    if colocated:
        terms["colocated work"] = work / instances + t
        terms["colocated tail"] = tail / (staleness + 1) + t
    else:
        terms["generation throughput"] = work / instances
    return terms
