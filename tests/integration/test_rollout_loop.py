"""RolloutLoop (operators/engines/rollout.py) driving the in-flight sim engine: no model, no Ray.

The sim engine is a cost model of a continuous-batching server (benchmarks/sim_engine.py); with a
tiny cost model and a large time_scale every group takes a fraction of a second. Checked: the cap on
sequences in flight, a freed slot refilled while group-mates still decode, partial rollout (a
weight update under running requests gives responses whose tokens span two versions, old ones
first), draining when partial rollout is off (one version per group), and the rows Generate makes
(`policy_version` is the group's oldest token's version). Orderings and counts, never wall-clock
bounds.
"""

from __future__ import annotations

import concurrent.futures
import json

import numpy as np
import pandas as pd
import pytest

from benchmarks.sim_engine import ENGINE as SIM
from operators.engines.base import SamplingParams
from operators.engines.factory import make_in_flight_engine
from operators.engines.rollout import RolloutLoop, wait_all

# 1 ms of simulated time per tick, 20x faster: a 400-token response takes 20 ms real;
# lengths lognormal (median 400, capped at 4000), 4 tokens per fake id.
COST = {"time_scale": 20, "token_unit": 4, "decode_step_s": 0.001, "decode_per_seq_s": 0.0, "max_num_seqs": 256,
        "weight_sync_s": 0.2, "length": {"median": 400, "sigma": 1.0, "cap": 4000}}


@pytest.fixture
def cost_path(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(COST))
    return str(path)


def make_loop(cost_path: str, cap: int, partial_rollout: bool = False) -> RolloutLoop:
    return RolloutLoop(make_in_flight_engine(SIM, cost_path), max_seqs_in_flight=cap, partial_rollout=partial_rollout)


def submit(loop: RolloutLoop, groups: int, n: int, offset: int = 0) -> list[concurrent.futures.Future]:
    prompts = loop.engine.encode([f"question {i}" for i in range(offset, offset + groups)])
    uids = [f"g{i}" for i in range(offset, offset + groups)]
    return loop.submit(prompts, SamplingParams(n=n), [0] * groups, uids)


def test_cap_is_respected_and_freed_slots_are_refilled_while_group_mates_decode(cost_path):
    loop = make_loop(cost_path, cap=6)
    try:
        results = wait_all(submit(loop, groups=8, n=4))
    finally:
        loop.close()
    assert 4 < loop.peak_in_flight <= 6  # a second group joined the first, never more than the cap
    ordered = sorted(results, key=lambda r: r.start)
    # Some group started while an earlier one still had a response decoding: its slots came from
    # finished group-mates, not from the whole group leaving.
    assert any(later.start < earlier.end for i, earlier in enumerate(ordered) for later in ordered[i + 1:])
    lengths = [len(tokens) for r in results for tokens in r.sample.token_ids]
    assert len(lengths) == 32 and min(lengths) >= 1 and len(set(lengths)) > 8  # long-tailed, one id at least


def test_engine_lengths_follow_the_prompt_in_both_interfaces(cost_path):
    from operators.engines.factory import make_engine

    loop = make_loop(cost_path, cap=64)
    try:
        streamed = [r.sample.token_ids for r in wait_all(submit(loop, groups=4, n=8))]
    finally:
        loop.close()
    engine = make_engine(SIM, cost_path)
    called = [g.token_ids for g in engine.generate(engine.encode([f"question {i}" for i in range(4)]),
                                                   SamplingParams(n=8))]
    assert streamed == called  # the same workload, however it is driven


def _first_done_then_load(loop: RolloutLoop, futures: list, version: int = 1):
    concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
    return loop.load_policy(version, {"version": np.array(version)})


def test_partial_rollout_keeps_requests_through_an_update_and_tags_every_token(cost_path):
    loop = make_loop(cost_path, cap=64, partial_rollout=True)
    try:
        futures = submit(loop, groups=8, n=4)
        update = _first_done_then_load(loop, futures)
        results = wait_all(futures)
    finally:
        loop.close()
    assert update.version == 1 and update.in_flight > 0  # the swap happened under running requests
    spanning = [r for r in results if r.version_min == 0 and r.version_max == 1]
    assert spanning, [(r.version_min, r.version_max) for r in results]
    for r in results:
        for tokens, versions in zip(r.sample.token_ids, r.token_versions):
            assert len(versions) == len(tokens) and versions == sorted(versions)  # old tokens first
            assert set(versions) <= {0, 1}
    # A response that had decoded some ids when the engine froze keeps them under version 0.
    assert any(0 in versions and 1 in versions for r in spanning for versions in r.token_versions)


def test_without_partial_rollout_the_update_drains_and_every_group_has_one_version(cost_path):
    loop = make_loop(cost_path, cap=8)  # two groups of 4 at a time: the rest start after the update
    try:
        futures = submit(loop, groups=6, n=4)
        update = _first_done_then_load(loop, futures)
        results = wait_all(futures)
    finally:
        loop.close()
    assert update.version == 1
    for r in results:
        assert r.version_min == r.version_max, r.token_versions
    versions = [r.version_min for r in results]
    assert 0 in versions and 1 in versions  # drained under 0; the held groups went on under 1
    # The update waited for the first group to finish, and no group of the new version started before it.
    assert min(r.start for r in results if r.version_min == 1) > min(r.end for r in results if r.version_min == 0)


def test_generate_rows_report_the_oldest_token_version(cost_path):
    from operators.stages.generate import Generate

    generate = Generate(cost_path, engine=SIM, n=4, in_flight=True, max_seqs_in_flight=64, partial_rollout=True)
    batch = pd.DataFrame({"prompt": [f"question {i}" for i in range(8)], "group_uid": [f"g{i}" for i in range(8)]})
    rows = []
    try:
        for frame in generate(batch):  # each group leaves as a one-row frame the moment it is done
            rows.append(frame)
            if len(rows) == 1:
                generate.load_policy(1, {"version": np.array(1)})  # the other seven are still decoding
    finally:
        generate.close()
    table = pd.concat(rows, ignore_index=True)
    assert len(table) == 8 and sorted(table["group_uid"]) == sorted(batch["group_uid"])
    for _, row in table.iterrows():
        tokens = [v for response in row["token_policy_versions"] for v in response]
        assert row["policy_version"] == min(tokens) and row["policy_version_max"] == max(tokens)
        assert [len(v) for v in row["token_policy_versions"]] == row["response_lengths"]
    assert ((table["policy_version"] == 0) & (table["policy_version_max"] == 1)).any()


def test_an_engine_is_named_by_its_import_path_and_a_bad_one_says_why():
    """The package names only hf and vllm; any other engine (here the benchmarks' simulator) is
    'module:Class', and one that cannot be found is refused naming what to check."""
    from benchmarks.sim_engine import SimEngine
    from operators.engines.factory import engine_class, has_in_flight_form

    assert engine_class(SIM) is SimEngine and has_in_flight_form(SIM)
    assert has_in_flight_form("vllm") and not has_in_flight_form("hf")
    with pytest.raises(ValueError, match="cannot be imported"):
        engine_class("benchmarks.no_such_module:Engine")
    with pytest.raises(ValueError, match="use 'hf', 'vllm' or 'module:Class'"):
        make_in_flight_engine("sim", "cost.json")
