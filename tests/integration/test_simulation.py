"""The simulated engine and trainer inside the real DAG (benchmarks/simulate_cluster.py's parts).

The DAG, policy store, staleness gate, rollout loop and Train operator are real; the engine is
the continuous-batching cost model (`benchmarks/sim_engine.py`) and the trainer sleeps its
modelled cost (`benchmarks/sim_trainer.py`). Checked: the cost model's timing; the in-flight
form's pause contract (keep: frozen, decoded tokens flushed before pause returns; wait: drained,
new requests held); then in the DAG, in flight at max_staleness 0, with partial rollout at 2
and call-synchronous at 2, every group is trained exactly once within the bound (staleness of
the oldest token; on-policy at 0), partial rollout gives groups spanning versions, and with a
long-tailed length distribution and training as costly as generation, async finishes the same
steps sooner than sync. (tests/integration/test_rollout_loop.py drives the rollout loop itself.)
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from benchmarks import sim_trainer
from benchmarks.sim_cost import CostModel, LengthModel
from benchmarks.sim_engine import ENGINE as SIM, SimEngine
from benchmarks.sim_server import DecodeServer
from operators.engines.base import SamplingParams
from operators.engines.factory import make_engine

ROOT = Path(__file__).resolve().parents[2]

STEPS, GROUPS, N = 5, 4, 8


def test_decode_server_batches_continuously():
    # One instance, 2 slots, tick 20 ms simulated, time x100: lengths 1000, 1000, 500, 500
    # -> the two 500s wait for slots, then run: 1500 ticks = 30 s simulated = 0.3 s real.
    server = DecodeServer(CostModel(time_scale=100, decode_step_s=0.02, decode_per_seq_s=0.0, max_num_seqs=2))
    start = time.monotonic()
    server.run([1000, 1000, 500, 500])
    assert 0.29 < time.monotonic() - start < 0.45
    # Two callers share the tick loop: the short call ends first, the tail overlaps it.
    server = DecodeServer(CostModel(time_scale=100, decode_step_s=0.02, decode_per_seq_s=0.001))
    ends = {}

    def call(name, lengths):
        server.run(lengths)
        ends[name] = time.monotonic() - start

    start = time.monotonic()
    long = threading.Thread(target=call, args=("long", [1000] * 10))
    long.start()
    call("short", [500] * 10)
    long.join()
    # 20 active: 40 ms/tick for 500 ticks (0.2 s), then 10 active: 30 ms/tick for 500 (0.15 s)
    assert ends["short"] == pytest.approx(0.20, abs=0.06)
    assert ends["long"] == pytest.approx(0.35, abs=0.08)


def test_sim_engine_is_reproducible_and_long_tailed(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"time_scale": 1e6, "token_unit": 16, "length": {"median": 100, "sigma": 1.0, "cap": 2000}}))
    engine = make_engine(SIM, str(path), torch_threads=1)
    ids = engine.encode([f"q{i}" for i in range(64)])
    first = engine.generate(ids, SamplingParams(n=16, seed=1))
    again = engine.generate(ids, SamplingParams(n=16, seed=2))  # lengths follow the prompt, not the call seed
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    lengths = pd.Series([len(t) * 16 for g in first for t in g.token_ids])
    assert lengths.quantile(0.99) > 5 * lengths.median()  # a long tail
    assert all(len(g.token_ids) == 16 and len(g.logprobs[0]) == len(g.token_ids[0]) for g in first)


def _in_flight_engine(tmp_path: Path) -> SimEngine:
    # 1 ms per tick, 5x faster: 0.2 ms real per tick; lengths median 400, cap 4000 (80 ms and 0.8 s real)
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"time_scale": 5, "token_unit": 4, "decode_step_s": 0.001, "decode_per_seq_s": 0.0,
                                "weight_sync_s": 0.2, "length": {"median": 400, "sigma": 1.0, "cap": 4000}}))
    return SimEngine(str(path))


async def _consume(engine: SimEngine, prompt: str, n: int, got: list) -> None:
    async for delta in engine.stream(engine.encode([prompt])[0], SamplingParams(n=n), 0, prompt, "salt"):
        got.append(delta)


def _tokens(deltas: list) -> int:
    return sum(len(d.token_ids) for d in deltas)


def test_in_flight_pause_keep_freezes_and_flushes_what_was_decoded(tmp_path):
    engine = _in_flight_engine(tmp_path)
    expected = [engine.cost.ids(int(x)) for x in engine.draw_lengths(engine.encode(["long"]), 16)[0]]

    async def main():
        await engine.start()
        got: list = []
        task = asyncio.create_task(_consume(engine, "long", 16, got))
        while not any(d.finished for d in got):  # decoding has gone on for a while
            await asyncio.sleep(0.001)
        await engine.pause("keep")
        at_pause = list(got)  # delivered before pause returned
        for _ in range(20):
            await asyncio.sleep(0.005)
        frozen = list(got)
        await engine.load_prepared(1)
        await engine.resume()
        await task
        await engine.shutdown()
        return at_pause, frozen, got

    at_pause, frozen, got = asyncio.run(main())
    assert frozen == at_pause  # nothing sampled while paused
    unfinished = {d.sample for d in at_pause} - {d.sample for d in at_pause if d.finished}
    flushed = [d for d in at_pause if not d.finished]
    assert unfinished and {d.sample for d in flushed} == unfinished  # every running sample flushed its tokens
    assert all(d.token_ids for d in flushed)
    per_sample = [sum(len(d.token_ids) for d in got if d.sample == i) for i in range(16)]
    assert per_sample == expected  # flushed + rest = the whole response, once
    assert [d.sample for d in got if d.finished] and sorted(d.sample for d in got if d.finished) == list(range(16))


def test_in_flight_pause_wait_drains_and_holds_new_requests(tmp_path):
    engine = _in_flight_engine(tmp_path)

    async def main():
        await engine.start()
        first: list = []
        running = asyncio.create_task(_consume(engine, "first", 8, first))
        await asyncio.sleep(0.002)
        await engine.pause("wait")
        drained = sum(d.finished for d in first)
        later: list = []
        held = asyncio.create_task(_consume(engine, "later", 8, later))
        for _ in range(10):
            await asyncio.sleep(0.005)
        before_resume = len(later)
        await engine.load_prepared(1)
        await engine.resume()
        await asyncio.gather(running, held)
        await engine.shutdown()
        return drained, before_resume, later

    drained, before_resume, later = asyncio.run(main())
    assert drained == 8  # pause("wait") returned once every request in flight had finished
    assert before_resume == 0  # a request made while paused waited for resume()
    assert sum(d.finished for d in later) == 8


def test_in_flight_abort_frees_the_slots(tmp_path):
    engine = _in_flight_engine(tmp_path)

    async def main():
        await engine.start()
        got: list = []
        task = asyncio.create_task(_consume(engine, "long", 16, got))
        await asyncio.sleep(0)  # the request is in
        await engine.abort("long")
        await task  # the stream ends
        left = engine.server.in_flight()
        await engine.shutdown()
        return got, left

    got, left = asyncio.run(main())
    assert left == 0 and sum(d.finished for d in got) < 16


def run_sim(ray, tmp_path: Path, max_staleness: int, cost: CostModel, **rollout) -> tuple[list[dict], list[float], list]:
    from pipelines.config.load import load_config
    from pipelines.dag import build_rl_dataset, iter_steps, schedule_groups
    from pipelines.runtime.policy_store import create_policy_store

    # Every Generate actor up before the first call is dispatched: an in-flight actor takes several calls
    # at once, so the first one up would otherwise take them all (and Ray Data kills an idle one).
    ray.data.DataContext.get_current().wait_for_min_actors_s = 600
    tag = f"{max_staleness}-{'-'.join(map(str, rollout.values()))}"
    path = tmp_path / f"cost-{tag}.json"
    path.write_text(json.dumps(cost.to_dict()))
    overrides = {
        "train.steps": STEPS, "train.groups_per_step": GROUPS, "train.max_staleness": max_staleness,
        "rollout.n": N, "rollout.groups_per_call": 2, "rollout.num_actors": 2, "rollout.num_cpus": 0.1,
        "train.num_cpus": 0.1, "tracking.enabled": False, "output_dir": str(tmp_path),
    }
    cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", [f"{k}={v}" for k, v in overrides.items()])
    cfg.rollout.engine = SIM  # after validation (the config knows hf/vllm), like the options below
    for key, value in rollout.items():
        setattr(cfg.rollout, key, value)
    prompts = pd.DataFrame({"prompt_id": [f"p{i}" for i in range(STEPS * GROUPS)],
                            "prompt": [f"question {i}" for i in range(STEPS * GROUPS)], "answer": "0"})
    schedule = schedule_groups(prompts, cfg)
    store_name = f"sim-test-store-{tag}"
    store = create_policy_store(store_name)
    workers = sim_trainer.start_sim_trainers(str(path), store)
    rows, times = [], []
    try:
        start = time.perf_counter()
        for row in iter_steps(build_rl_dataset(schedule, cfg, str(path), store, workers)):
            times.append(time.perf_counter() - start)
            row["rollouts"] = pd.read_parquet(io.BytesIO(row.pop("rollouts_parquet")))
            rows.append(row)
    finally:
        for actor in [*workers, store]:
            ray.kill(actor)
    return rows, times, schedule


# make test-extended (CI stays under 45 minutes): the bound and exactly-once stay in CI on the real DAG
# (tests/e2e/test_pipeline.py); `python benchmarks/simulate_cluster.py` is the measurement.
@pytest.mark.extended
def test_simulated_dag_bound_exactly_once_and_async_faster(ray_cluster, tmp_path):
    # Long-tailed lengths (p99 ~ 10x median): a step's generation lasts as long as its longest response
    # (up to 2.4 s real), its training 0.4 s, so sync takes ~2-3 s a step; async overlaps steps, and as
    # generation is the slower side, weight updates land while responses decode (partial rollout).
    cost = CostModel(time_scale=100, token_unit=64, decode_step_s=0.04, decode_per_seq_s=0.0, max_num_seqs=64,
                     weight_sync_s=1.0, length=LengthModel(median=800, sigma=1.0, cap=6000),
                     train_seconds_per_token=0.0, train_step_fixed_s=40.0)
    runs = {  # name: (max_staleness, rollout options); the sim engine runs in flight unless in_flight is False
        "sync": (0, {}),
        "partial": (2, {"partial_rollout": True}),
        "call-synchronous": (2, {"in_flight": False}),
    }
    walls, spanning = {}, {}
    for name, (max_staleness, rollout) in runs.items():
        rows, times, schedule = run_sim(ray_cluster, tmp_path, max_staleness, cost, **rollout)
        assert [row["step"] for row in rows] == list(range(1, STEPS + 1))  # no deadlock
        groups = pd.concat([row["rollouts"] for row in rows], ignore_index=True)
        expected = [uid for frame in schedule for uid in frame["group_uid"]]
        assert sorted(groups["group_uid"]) == sorted(expected) and groups["group_uid"].is_unique
        assert groups["staleness"].between(0, max_staleness).all(), groups["staleness"].value_counts()
        oldest = groups["token_policy_versions"].map(lambda cell: min(min(r) for r in cell))
        assert (oldest == groups["policy_version"]).all()  # staleness is the oldest token's
        if max_staleness == 0:
            assert (groups["policy_version"] == groups["train_step"]).all()
            assert (groups["policy_version_max"] == groups["policy_version"]).all()
        else:
            assert groups["staleness"].max() >= 1  # generation did run ahead
        spanning[name] = int((groups["policy_version_max"] > groups["policy_version"]).sum())
        walls[name] = times[-1] - times[0]  # steps 1..4; actor start-up kept out
    assert spanning["partial"] > 0 and spanning["call-synchronous"] == 0, spanning
    assert walls["partial"] < 0.8 * walls["sync"], walls


def test_unknown_cost_model_field_is_named(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"decode_step": 0.01}))
    with pytest.raises(ValueError, match="decode_step"):
        make_engine(SIM, str(path))


def test_sim_trainer_cost(tmp_path):
    cost = replace(CostModel(), token_unit=10, prompt_tokens=5, train_seconds_per_token=0.5, train_gpus=4,
                   train_step_fixed_s=2.0)
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(cost.to_dict()))
    worker = sim_trainer.SimTrainWorker.__new__(sim_trainer.SimTrainWorker)
    worker.cost = CostModel.load(path)
    # 100 ids x 10 tokens + 8 sequences x 5 prompt tokens = 1040 tokens; 0.5 x 1040 / 4 + 2 = 132 s
    assert worker.step_seconds(100, 8) == pytest.approx(132.0)
