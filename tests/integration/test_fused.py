"""Operators fused into one Ray Data stage (operators/stages/chain.py): the same rows as the stages one by one."""

from __future__ import annotations

import threading
import time

import pandas as pd
import pytest
import ray

from operators.stages.advantage import Advantage
from operators.stages.reward import Reward
from operators.stages.train import Train
from operators.stages.chain import Chain


def groups(answers: list[str], responses: list[list[str]]) -> pd.DataFrame:
    return pd.DataFrame({
        "prompt": [f"{a}?" for a in answers], "answer": answers, "responses": responses,
        "group_uid": [f"g{index}" for index in range(len(answers))],
    })


class EveryOther:
    """A generator operator like Train: yields rows only on every second call, two batches at once."""

    def __init__(self):
        self.held: list[pd.DataFrame] = []

    def __call__(self, batch: pd.DataFrame):
        self.held.append(batch.assign(seen=len(self.held)))
        if len(self.held) == 2:
            yield from self.held
            self.held = []


def test_chain_equals_the_operators_one_by_one():
    batch = groups(["3", "7"], [["3", "4", "3"], ["7", "7", "1"]])
    chained = list(Chain([(Reward, {}), (Advantage, {"estimator": "rloo"})])(batch))
    alone = Advantage(estimator="rloo")(Reward()(batch))
    assert len(chained) == 1
    timing = ["time_reward", "time_advantage"]
    pd.testing.assert_frame_equal(chained[0].drop(columns=timing), alone.drop(columns=timing))
    assert chained[0]["rewards"].tolist() == [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]


def test_chain_passes_each_yielded_batch_on_and_holds_none_back():
    chain = Chain([(EveryOther, {}), (Reward, {})])
    first = list(chain(groups(["1"], [["1"]])))
    second = list(chain(groups(["2"], [["0"]])))
    assert first == [] and len(second) == 2
    assert [part["seen"].tolist() for part in second] == [[0], [1]]
    assert [part["rewards"].tolist() for part in second] == [[[1.0]], [[0.0]]]


def test_chain_needs_a_stage():
    with pytest.raises(ValueError, match="at least one stage"):
        Chain([])


def test_chain_as_one_ray_data_stage(ray_cluster):
    batches = [groups([str(a)], [[str(a), "x"]]).assign(group_uid=f"g{a}") for a in range(6)]
    ds = ray.data.from_pandas(batches).map_batches(
        Chain, fn_constructor_kwargs={"stages": [(Reward, {"timestamps": True}), (Advantage, {})]},
        compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0.1, batch_size=None, batch_format="pandas",
    )
    out = ds.to_pandas().sort_values("group_uid").reset_index(drop=True)
    assert out["group_uid"].tolist() == [f"g{a}" for a in range(6)]  # every group once
    assert out["rewards"].map(list).tolist() == [[1.0, 0.0]] * 6
    assert (out["reward_start"] <= out["reward_end"]).all()
    assert all(len(advantages) == 2 and advantages[0] > advantages[1] for advantages in out["advantages"])


def test_reward_timestamps_are_opt_in():
    batch = groups(["3"], [["3"]])
    assert "reward_start" not in Reward()(batch).columns
    stamped = Reward(timestamps=True)(batch)
    assert (stamped["reward_start"] <= stamped["reward_end"]).all()


class RecordedTrain(Train):
    """The Train operator with its step recorded instead of run on DeepSpeed ranks: what is checked
    here is the buffering and ordering around the step, which calls side by side share."""

    def _run_step(self, step: int, rows: list[dict]) -> pd.DataFrame:
        self.trained.append((step, sorted(row["group_uid"] for row in rows)))
        time.sleep(0.002)  # a step takes a while: other calls arrive meanwhile
        return pd.DataFrame([{"step": step}])


def test_train_calls_side_by_side_train_every_step_once_in_order():
    steps, groups = 30, 3
    train = RecordedTrain([], groups_per_step=groups, total_steps=steps)
    train.trained = []
    # Arrival order mixes neighbouring steps, as several generators would.
    rows = [{"group_uid": f"s{step}g{group}", "train_step": step, "policy_version": step}
            for step in range(steps) for group in range(groups)]
    order = sorted(range(len(rows)), key=lambda index: index + (7 if index % 4 == 0 else 0))
    pending = [pd.DataFrame([rows[index]]) for index in order]
    lock, emitted = threading.Lock(), []

    def call_loop():
        while True:
            with lock:
                if not pending:
                    return
                batch = pending.pop(0)
            for frame in train(batch):
                emitted.append(int(frame["step"].iloc[0]))

    threads = [threading.Thread(target=call_loop) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert [step for step, _ in train.trained] == list(range(steps))  # each once, in order, none left behind
    assert all(uids == [f"s{step}g{g}" for g in range(groups)] for step, uids in train.trained)
    assert emitted == list(range(steps))  # the rows leave in step order too
    assert not train.buffer


def test_reward_sandbox_serves_calls_from_several_threads():
    reward = Reward(timeout_s=30)
    try:
        answers = [str(a) for a in range(12)]
        batches = [groups([a], [[a, "x", a]]) for a in answers]
        results: dict[str, list] = {}

        def score(batch):
            results[batch["answer"].iloc[0]] = reward(batch)["rewards"].iloc[0]

        threads = [threading.Thread(target=score, args=(batch,)) for batch in batches]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert results == {a: [1.0, 0.0, 1.0] for a in answers}
    finally:
        reward.close()
