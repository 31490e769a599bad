"""The simulation's bound without foresight: the best step a schedule that batches each response by its
age could reach under simulate_cluster.py's cost model (benchmarks/sim_bound.py is the bound with foresight).

    python benchmarks/sim_bound.py     # adds both to results/simulation*.json and prints them side by side

sim_bound.py's bound lets the step's longest response decode alone at tick(1) while every other token
decodes in full batches of m = max_num_seqs. Only a schedule that knows which response will be the
longest can do both. In the cost model a response's length is a random draw (benchmarks/sim_engine.py
`LengthModel`, seeded by a hash of its prompt only so that every schedule decodes the same workload):
nothing a scheduler sees, the prompt's text, its group or the other responses, tells it. What a
scheduler can know of a response's remaining length is how long it has run: its age. A tail-isolating scheduler is such
a schedule: it moves a response that has run past a threshold to an instance with a small batch.

Here every response decodes the tokens of its age tier j (ages [j u, (j + 1) u), u = token_unit) in a
batch of b_j sequences, the same b_j for every response: a policy b. Per step, with M_j the tokens the
step decodes in tier j and l_j those of its longest response (means over the timed steps),

  tail(b) = sum_j l_j x tick(b_j)                  the longest response's decode, tier after tier
  work(b) = sum_j M_j x tick(b_j) / b_j            instance-seconds (a tick of b_j sequences yields b_j tokens)

and the bound's inequalities hold with tail(b) for Lmax x tick(1) and work(b) for the full-batch work
(sim_bound.py's docstring): per layout and policy, P = the largest term, which grows with tail and with
work. The estimate is the least P over layouts and policies, taken over the lower convex hull of the
(tail, work) pairs the policies reach: every policy's pair is weakly beaten in both by a point of that
hull, so the least P over the hull is at most the least over the policies (it errs low, never high).
The hull's corners are the policies minimising tail + lam x work for lam >= 0, tier by tier (the terms
separate by tier: b_j = argmin_b (l_j + lam M_j / b) tick(b)), found exactly (`tier_policies`); P is
taken along each edge between two corners at GRID points (`best_tiered`). On the recorded workload the
hull has ~24,000 corners, so an edge is short and the grid's error is far below the figures' precision.

It keeps every idealisation of the bound (no DAG overhead, balanced instances, admission the moment a
gate opens, one load per version on the critical path) and adds some: moving a response to an instance
of another batch costs nothing (no prefill), and every instance runs exactly the batch its tier asks for
(the few responses old enough for the last tiers would in fact leave part of an instance idle). So it is
optimistic for age-batched schedules: a schedule of that kind does at best this well, and a run's ratio
to it says how much of the bound's gap any such scheduler (tail isolation included) could close.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from benchmarks.sim_cost import CostModel
from benchmarks.sim_terms import layout_terms, train_step_s

GRID = 11  # points per hull edge at which the step is taken (its ends included)


@dataclass(frozen=True)
class Tiers:
    """A step's decoding by age tier (means over steps): tokens decoded in each tier (M), and the
    longest response's tokens in each (l); tier j holds ages [j x width, (j + 1) x width)."""

    width: int
    tokens: np.ndarray  # M_j
    longest: np.ndarray  # l_j


@dataclass(frozen=True)
class TierPolicy:
    """A policy (a batch per tier) with its longest response's decode seconds and its instance-seconds."""

    batches: np.ndarray
    tail_s: float
    work_s: float


@dataclass(frozen=True)
class TierBound:
    step_s: float
    gen_gpus: int
    train_gpus: int
    colocated: bool
    limit: str
    policy: TierPolicy  # the hull corner nearest the best point
    tail_s: float  # the best point's tail and work (on the hull: a corner, or between two)
    work_s: float


def tiers(steps: list[np.ndarray], cost: CostModel) -> Tiers:
    """The mean step's tokens per age tier (width token_unit, up to the length cap), and its longest's."""
    width = cost.token_unit
    starts = np.arange(0, int(cost.length.cap), width, dtype=np.float64)
    tokens, longest = np.zeros(starts.size), np.zeros(starts.size)
    for lengths in steps:
        lengths = np.sort(np.asarray(lengths, dtype=np.float64))
        # tokens in tier [a, a + w): sum_i clip(L_i - a, 0, w)
        tokens += _tokens_past(lengths, starts) - _tokens_past(lengths, starts + width)
        longest += np.clip(lengths[-1] - starts, 0, width)
    return Tiers(width, tokens / len(steps), longest / len(steps))


def _tokens_past(sorted_lengths: np.ndarray, ages: np.ndarray) -> np.ndarray:
    """sum_i max(L_i - age, 0) for each age: the tokens decoded past that age, from the prefix sums."""
    totals = np.concatenate([[0.0], np.cumsum(sorted_lengths)])
    first = np.searchsorted(sorted_lengths, ages, side="right")
    return totals[-1] - totals[first] - (sorted_lengths.size - first) * ages


def tier_policies(tiered: Tiers, cost: CostModel) -> list[TierPolicy]:
    """The corners of the lower convex hull of the (tail, work) pairs the policies reach, by tail: each
    minimises tail + lam x work for some lam, tier by tier. Built exactly: between two corners, the lam
    at which they tie either gives a policy below the line through them (a corner between, searched in
    turn) or none (they are neighbours on the hull)."""
    batch = np.arange(1, cost.max_num_seqs + 1, dtype=np.float64)
    tick = cost.decode_step_s + cost.decode_per_seq_s * batch  # [B]

    tail = tiered.longest[:, None] * tick  # [tiers, B]: the longest response's seconds in the tier
    work = tiered.tokens[:, None] * tick / batch  # [tiers, B]: instance-seconds of the tier's tokens

    def policy(chosen: np.ndarray) -> TierPolicy:
        return TierPolicy(batch[chosen].astype(np.int64), float(tail[np.arange(len(chosen)), chosen].sum()),
                          float(work[np.arange(len(chosen)), chosen].sum()))

    def minimising(lam: float) -> TierPolicy:
        return policy(np.argmin(tail + lam * work, axis=1))

    def lexicographic(first: np.ndarray, then: np.ndarray) -> TierPolicy:  # least `first`, ties by least `then`
        tied = first <= first.min(axis=1, keepdims=True) * (1 + 1e-12)
        return policy(np.argmin(np.where(tied, then, np.inf), axis=1))

    # the ends: the shortest tail (ties broken by less work) and the least work (ties by shorter tail)
    shortest, cheapest = lexicographic(tail, work), lexicographic(work, tail)
    if shortest.work_s <= cheapest.work_s + 1e-12:  # one policy is best at both
        return [shortest]
    corners, edges = [shortest, cheapest], [(shortest, cheapest)]
    while edges:
        left, right = edges.pop()
        lam = (right.tail_s - left.tail_s) / (left.work_s - right.work_s)
        middle = minimising(lam)
        gain = left.tail_s + lam * left.work_s - (middle.tail_s + lam * middle.work_s)
        if gain > 1e-9 * (1.0 + left.tail_s + lam * left.work_s):
            corners.append(middle)
            edges += [(left, middle), (middle, right)]
    return sorted(corners, key=lambda policy: policy.tail_s)


def one_batch_policies(tiered: Tiers, cost: CostModel) -> list[TierPolicy]:
    """The policies with one batch at every age (an in-flight cap per instance, as the runs have), 1 to m."""
    count = len(tiered.tokens)
    policies = []
    for batch in range(1, cost.max_num_seqs + 1):
        tick = cost.tick_seconds(batch)
        policies.append(TierPolicy(np.full(count, batch, dtype=np.int64), float(tiered.longest.sum() * tick),
                                   float(tiered.tokens.sum() * tick / batch)))
    return policies


def best_tiered(policies: list[TierPolicy], trained_tokens: float, cost: CostModel, gpus: int, staleness: int,
                layouts: list[tuple[int, int, bool]] | None = None, edges: bool = True) -> TierBound:
    """The least seconds per step over the hull of the policies' (tail, work) and the layouts (default:
    colocated, and every split of `gpus`, as sim_bound.best_bound). `policy` is the hull corner nearest
    the best point. `edges=False`: over the policies themselves only (one_batch_policies)."""
    if layouts is None:
        layouts = [(gpus, gpus, True)] + [(gen, gpus - gen, False)
                                          for gen in range(cost.gpus_per_instance, gpus, cost.gpus_per_instance)]
    corners = sorted(policies, key=lambda policy: (policy.tail_s, policy.work_s))
    tails, works = np.array([p.tail_s for p in corners]), np.array([p.work_s for p in corners])  # [corners]
    grid = np.linspace(0.0, 1.0, GRID)
    if edges and len(corners) > 1:  # [edges, GRID]: the points of every edge between consecutive corners
        tail = tails[:-1, None] + grid * (tails[1:] - tails[:-1])[:, None]
        decode = works[:-1, None] + grid * (works[1:] - works[:-1])[:, None]
        corner = np.where(grid <= 0.5, 0, 1)[None, :] + np.arange(len(corners) - 1)[:, None]
    else:
        tail, decode, corner = tails[:, None], works[:, None], np.arange(len(corners))[:, None]
    best = None
    for gen, train, colocated in layouts:
        terms = layout_terms(tail, decode, train_step_s(cost, trained_tokens, train), cost, gen, staleness, colocated)
        step = np.max(np.stack(list(terms.values())), axis=0)
        at = np.unravel_index(np.argmin(step), step.shape)
        if best is None or step[at] < best.step_s:
            limit = max(terms, key=lambda name: terms[name][at])
            best = TierBound(float(step[at]), gen, train, colocated, limit, corners[int(corner[at])],
                             float(tail[at]), float(decode[at]))
    return best
