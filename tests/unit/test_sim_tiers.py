"""The simulation's bound without foresight (benchmarks/sim_tiers.py): tiers by hand, the hull against
every policy of a small case, equality with the bound where batching costs nothing, and the records."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import numpy as np
import pytest

from benchmarks.sim_bound import RESULT_FILES, RESULTS, best_bound, mean_work, timed_steps, train_s
from benchmarks.sim_cost import CostModel, LengthModel
from benchmarks.sim_terms import layout_terms
from benchmarks.sim_tiers import TierPolicy, best_tiered, tier_policies, tiers

# tick(x) = 0.1 + 0.05 x seconds, 3 sequences per instance, tiers of 4 tokens up to 12.
SMALL = CostModel(decode_step_s=0.1, decode_per_seq_s=0.05, max_num_seqs=3, weight_sync_s=1.0,
                  train_seconds_per_token=0.1, train_step_fixed_s=0.2, prompt_tokens=0, token_unit=4,
                  length=LengthModel(cap=12))
STEPS = [np.array([10, 2, 2, 2]), np.array([12, 5, 1, 1])]


def test_tiers_count_each_steps_tokens_by_age():
    tiered = tiers([np.array([10, 2, 2, 2])], SMALL)
    assert tiered.width == 4
    assert tiered.tokens.tolist() == [4 + 2 + 2 + 2, 4, 2]  # ages 0-3, 4-7, 8-11
    assert tiered.longest.tolist() == [4, 4, 2]
    both = tiers(STEPS, SMALL)  # the mean step: second step 4+4+1+1 / 4+1 / 4
    assert both.tokens.tolist() == [(10 + 10) / 2, (4 + 5) / 2, (2 + 4) / 2]
    assert both.longest.tolist() == [4, 4, (2 + 4) / 2]


def _every_policy(tiered, cost: CostModel) -> list[TierPolicy]:
    tick = lambda b: cost.decode_step_s + cost.decode_per_seq_s * b  # noqa: E731
    policies = []
    for batches in itertools.product(range(1, cost.max_num_seqs + 1), repeat=len(tiered.tokens)):
        b = np.array(batches)
        policies.append(TierPolicy(b, float(tiered.longest @ tick(b)), float(tiered.tokens @ (tick(b) / b))))
    return policies


def test_the_hull_lies_under_every_policy_and_its_corners_are_policies():
    tiered = tiers(STEPS, SMALL)
    every = _every_policy(tiered, SMALL)  # 3 batches ^ 3 tiers = 27 policies
    corners = tier_policies(tiered, SMALL)
    assert len(corners) >= 2
    points = {(round(p.tail_s, 9), round(p.work_s, 9)) for p in every}
    assert all((round(c.tail_s, 9), round(c.work_s, 9)) in points for c in corners)
    tails, works = [c.tail_s for c in corners], [c.work_s for c in corners]
    assert tails == sorted(tails) and works == sorted(works, reverse=True)
    for policy in every:  # on or above the hull: its work at the policy's tail is no more than the policy's
        assert policy.tail_s >= tails[0] - 1e-9 and policy.work_s >= works[-1] - 1e-9
        hull_work = np.interp(policy.tail_s, tails, works)
        assert hull_work <= policy.work_s + 1e-9


@pytest.mark.parametrize("staleness", [0, 1, 2, 4])
def test_no_policy_beats_the_estimate_and_it_never_beats_the_bound(staleness):
    tiered = tiers(STEPS, SMALL)
    work = mean_work(STEPS, SMALL)
    estimate = best_tiered(tier_policies(tiered, SMALL), work.trained_tokens, SMALL, 4, staleness)
    layouts = [(4, 4, True), (1, 3, False), (2, 2, False), (3, 1, False)]
    for policy in _every_policy(tiered, SMALL):
        for gen, train, colocated in layouts:
            terms = layout_terms(np.array([policy.tail_s]), np.array([policy.work_s]), train_s(work, SMALL, train),
                                 SMALL, gen, staleness, colocated)
            assert max(float(v[0]) for v in terms.values()) >= estimate.step_s - 1e-9
    assert estimate.step_s >= best_bound(work, SMALL, 4, staleness).step_s - 1e-9


def test_without_a_per_sequence_cost_foresight_buys_nothing():
    # tick(b) the same for every batch: full batches are also the fastest, so the bound's tail and work are
    # reachable by age alone, at every staleness and GPU count
    cost = replace(CostModel.from_dict(json.loads((RESULTS / "simulation.json").read_text())["cost_model"]),
                   decode_per_seq_s=0.0)
    steps = [cost.length.draw(np.random.default_rng(seed), 2048) for seed in range(2)]
    work = mean_work(steps, cost)
    policies = tier_policies(tiers(steps, cost), cost)
    assert len(policies) == 1 and set(policies[0].batches.tolist()) == {cost.max_num_seqs}
    for gpus, staleness in itertools.product((8, 32), (0, 1, 4)):
        estimate = best_tiered(policies, work.trained_tokens, cost, gpus, staleness)
        assert estimate.step_s == pytest.approx(best_bound(work, cost, gpus, staleness).step_s)


@pytest.mark.parametrize("name", RESULT_FILES)
def test_every_recorded_run_is_within_its_estimate(name):
    result = json.loads((RESULTS / name).read_text())
    for record in result["records"]:
        aged, bound = record["age_batched"], record["bound"]
        assert bound["sim_seconds_per_step"] <= aged["sim_seconds_per_step"] <= record["sim_seconds_per_step"]
        # one batch at every age is one of the age-batched policies, and the runs cap each instance alike
        assert aged["sim_seconds_per_step"] <= aged["one_batch"]["sim_seconds_per_step"] <= record["sim_seconds_per_step"]
        assert aged["sim_seconds_per_step"] <= aged["sim_seconds_per_step_at_this_layout"] + 1e-9
        assert aged["ratio"] == pytest.approx(aged["sim_seconds_per_step"] / record["sim_seconds_per_step"], abs=1e-3)
        assert 0 < aged["bound_over_age_batched"] <= 1


def test_the_recorded_estimate_is_up_to_date():
    from benchmarks.sim_layout import scheduled_lengths

    result = json.loads((RESULTS / "simulation.json").read_text())
    cost = CostModel.from_dict(result["cost_model"])
    timed = timed_steps(scheduled_lengths(result["steps_per_run"], cost))
    work = mean_work(timed, cost)
    policies = tier_policies(tiers(timed, cost), cost)
    record = next(r for r in result["records"] if r["gpus"] == 128 and r["run"] == "d2")
    estimate = best_tiered(policies, work.trained_tokens, cost, 128, 2)
    assert record["age_batched"]["sim_seconds_per_step"] == pytest.approx(estimate.step_s, abs=0.01)
    assert (record["age_batched"]["gen_gpus"], record["age_batched"]["train_gpus"]) == (
        estimate.gen_gpus, estimate.train_gpus)
