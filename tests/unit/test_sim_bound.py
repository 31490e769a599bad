"""The simulation's bound (benchmarks/sim_bound.py): hand-computed layouts, its behaviour in staleness,
and the recorded runs of benchmarks/results/simulation*.json against it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.sim_bound import (
    RESULT_FILES, RESULTS, StepWork, best_bound, mean_work, steady_seconds_per_step, step_bound, step_work,
    sync_step_s, timed_steps,
)
from benchmarks.sim_cost import CostModel

# tick(x) = 0.1 + 0.01 * x seconds, 4 sequences per instance, 1 s per load, 0.1 s per trained token + 0.2 s a step.
HAND = CostModel(decode_step_s=0.1, decode_per_seq_s=0.01, max_num_seqs=4, weight_sync_s=1.0,
                 train_seconds_per_token=0.1, train_step_fixed_s=0.2, prompt_tokens=0, token_unit=1)
HAND_WORK = step_work(np.array([10, 2, 2, 2]), HAND)  # D = R = 16 tokens, Lmax = 10


def recorded(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def recorded_work(result: dict) -> StepWork:
    return StepWork(**{f: result["bound_workload"][f] for f in StepWork.__dataclass_fields__})


def test_step_work_charges_whole_fake_ids_and_prompts():
    cost = CostModel(token_unit=64, prompt_tokens=10)
    work = step_work(np.array([65, 1]), cost)
    assert work.decoded_tokens == 66
    assert work.trained_tokens == 3 * 64 + 2 * 10  # ceil(65/64) + ceil(1/64) ids, 2 prompts
    assert work.longest == 65
    assert mean_work([np.array([65, 1]), np.array([1, 1])], cost).decoded_tokens == pytest.approx(34.0)


def test_hand_computed_bounds_of_one_layout():
    # 2 generation GPUs, 2 training: t = 0.1 x 16 / 2 + 0.2 = 1.0; tail = 10 x tick(1) = 1.1;
    # work = 16 x (0.1 / 4 + 0.01) = 0.56 instance-s, 0.28 s on 2 instances; gen = max(1.1, 0.28) = 1.1.
    chain = 1.0 + 1.1 + 1.0  # load + gen + train = 3.1
    assert step_bound(HAND_WORK, HAND, 2, 2, 0).step_s == pytest.approx(chain)
    bound = step_bound(HAND_WORK, HAND, 2, 2, 1)
    assert (bound.step_s, bound.limit) == (pytest.approx(chain / 2), "staleness chain")
    assert step_bound(HAND_WORK, HAND, 2, 2, 2).step_s == pytest.approx(chain / 3)  # 1.033 > t = 1.0
    bound = step_bound(HAND_WORK, HAND, 2, 2, 4)  # chain 0.62: the trainer's 1.0 is the limit
    assert (bound.step_s, bound.limit) == (pytest.approx(1.0), "trainer")


def test_hand_computed_best_layout_of_four_gpus():
    # Colocated on 4: t = 0.1 x 16 / 4 + 0.2 = 0.6, gen = max(1.1, 0.56 / 4) = 1.1, sync = 1 + 1.1 + 0.6 = 2.7.
    assert sync_step_s(HAND_WORK, HAND, 4) == pytest.approx(2.7)
    best = best_bound(HAND_WORK, HAND, 4, 0)  # apart, 1/3 gives 1 + 1.1 + 0.733 = 2.83: colocated wins
    assert (best.step_s, best.colocated) == (pytest.approx(2.7), True)
    # s=1, colocated: max(chain 2.7 / 2, work 0.14 + 0.6, tail 1.1 / 2 + 0.6) = 1.35; apart 1/3: 2.83 / 2 = 1.42
    assert best_bound(HAND_WORK, HAND, 4, 1).step_s == pytest.approx(1.35)
    # s=4, colocated: the tail 1.1 / 5 + 0.6 = 0.82; apart 1/3: max(chain 0.567, trainer 0.733, gen 0.56) = 0.733
    best = best_bound(HAND_WORK, HAND, 4, 4)
    assert (best.step_s, best.gen_gpus, best.train_gpus, best.limit) == (
        pytest.approx(0.1 * 16 / 3 + 0.2), 1, 3, "trainer")


def recorded_cost_and_a_step() -> tuple[CostModel, StepWork]:
    """The recorded cost model and one step of 8192 responses drawn from its length model."""
    cost = CostModel.from_dict(recorded("simulation.json")["cost_model"])
    return cost, step_work(cost.length.draw(np.random.default_rng(0), 8192), cost)


def test_staleness_zero_is_the_synchronous_schedule():
    cost, work = recorded_cost_and_a_step()
    for gpus in (8, 32, 128):
        best = best_bound(work, cost, gpus, 0)
        assert best.colocated and best.step_s == pytest.approx(sync_step_s(work, cost, gpus))


def test_the_bound_never_rises_with_staleness():
    cost, work = recorded_cost_and_a_step()
    for gpus in (8, 32, 128):
        steps = [best_bound(work, cost, gpus, s).step_s for s in range(9)]
        assert all(later <= earlier + 1e-9 for earlier, later in zip(steps, steps[1:])), steps
        assert steps[-1] < steps[0]
        one_layout = [step_bound(work, cost, gpus // 2, gpus // 2, s).step_s for s in range(9)]
        assert all(later <= earlier + 1e-9 for earlier, later in zip(one_layout, one_layout[1:]))


@pytest.mark.parametrize("name", RESULT_FILES)
def test_every_recorded_speedup_is_within_its_bound(name):
    result = recorded(name)
    cost, work = CostModel.from_dict(result["cost_model"]), recorded_work(result)
    for record in result["records"]:
        bound = record["bound"]
        best = best_bound(work, cost, record["gpus"], record["max_staleness"])
        assert bound["sim_seconds_per_step"] == pytest.approx(best.step_s, abs=0.01)  # the file is up to date
        assert best.step_s <= record["sim_seconds_per_step"], record["schedule"]
        assert record["speedup_over_sync"] <= bound["speedup_over_sync"], record["schedule"]
        assert 0 < bound["ratio"] <= bound["ratio_at_this_layout"] <= 1, record["schedule"]
        own = step_bound(work, cost, record["gen_gpus"], record["train_gpus"], record["max_staleness"],
                         colocated=record["gen_gpus"] + record["train_gpus"] > record["gpus"])
        assert bound["sim_seconds_per_step_at_this_layout"] == pytest.approx(own.step_s, abs=0.01)


def test_the_workload_is_the_one_the_runs_decoded():
    from benchmarks.sim_layout import scheduled_lengths

    result = recorded("simulation.json")
    cost = CostModel.from_dict(result["cost_model"])
    lengths = scheduled_lengths(result["steps_per_run"], cost)
    assert [len(step) for step in lengths] == [result["samples_per_step"]] * result["steps_per_run"]
    assert mean_work(timed_steps(lengths), cost) == recorded_work(result)
    # The runs report tokens/s over the timed steps (whole fake ids); the drawn lengths give the same tokens.
    tokens = sum(float(np.ceil(step / cost.token_unit).sum()) * cost.token_unit for step in timed_steps(lengths))
    for record in result["records"]:
        assert record["sim_tokens_per_s"] * record["sim_seconds"] == pytest.approx(tokens, rel=1e-4)


def test_a_layout_without_gpus_is_refused():
    with pytest.raises(ValueError, match="gen_gpus"):
        step_bound(HAND_WORK, HAND, 0, 4, 1)
    with pytest.raises(ValueError, match="staleness"):
        step_bound(HAND_WORK, HAND, 2, 2, -1)


def test_the_steady_state_leaves_out_the_drained_steps():
    # steps end every 10 s until the generators run out; the last two come quickly, trained from what was made
    times = [0.0, 10.0, 20.0, 30.0, 40.0, 45.0, 48.0]
    assert steady_seconds_per_step(times, 1, 2, 3.0) == pytest.approx((40 - 10) / 3 * 3.0)
    assert (times[-1] - times[1]) / 5 < 10.0  # what the whole window would have said
    assert steady_seconds_per_step(times, 1, 0, 1.0) == pytest.approx((48 - 10) / 5)
    assert steady_seconds_per_step(times, 1, 4, 1.0) is None  # one step left: no steady state to speak of
