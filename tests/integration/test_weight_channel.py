"""The weight channel (operators/weights/buckets.py): buckets in the training dtype, a module-by-module walk
(one module's parameters gathered at a time under ZeRO-3), the object-store transport through a real
policy store, vLLM's safetensors file, and the object store sized from the config."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch

from operators.weights.buckets import WeightSet, as_weight_set, named_weights, non_finite, pack_buckets
from operators.weights.object_store import fetch
from pipelines.config.base import ConfigError
from pipelines.config.load import load_config


def _tiny_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("tied", [False, True])
def test_the_walk_yields_the_state_dict_gathering_one_module_at_a_time(tied):
    model = _tiny_llama(tied)
    expected = model.state_dict()
    active, calls, peak = set(), [], [0]

    @contextlib.contextmanager
    def gathered(params):  # stands for deepspeed.zero.GatheredParameters: records what is whole at once
        calls.append(len(params))
        active.update(map(id, params))
        peak[0] = max(peak[0], len(active))
        yield
        active.difference_update(map(id, params))

    walked = dict(named_weights(model, gathered))
    assert list(walked) == list(expected)  # every entry, in state-dict order, tied weights under each name
    for name, tensor in expected.items():
        assert torch.equal(walked[name], tensor), name
    # never more than one module's own parameters (a norm's 1, a linear's 1, never the whole model)
    largest_module = max(len(list(m.parameters(recurse=False))) for m in model.modules())
    assert peak[0] <= largest_module < len(list(model.parameters()))
    assert len(calls) == sum(1 for m in model.modules() if list(m.parameters(recurse=False)))


def test_buckets_hold_at_most_their_size_in_order_and_round_trip_in_bf16():
    model = _tiny_llama(tied=False)
    expected = {name: t.to(torch.bfloat16) for name, t in model.state_dict().items()}
    bucket_mb = 2048 / 2**20  # 2 KiB: 1024 bf16 weights
    buckets = list(pack_buckets(named_weights(model), bucket_mb=bucket_mb, dtype="bfloat16"))
    assert len(buckets) > 3 and all(b.dtype == "bfloat16" and b.data.dtype == np.uint16 for b in buckets)
    for bucket in buckets:  # full up to the limit, except a single tensor larger than a bucket
        assert bucket.nbytes <= 2048 or len(bucket.names) == 1
    weights = WeightSet(buckets)
    assert weights.names() == list(expected)
    assert weights.nbytes == 2 * sum(t.numel() for t in expected.values())  # two bytes a weight
    for name, tensor in weights.tensors():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name]), name


def test_the_safetensors_file_holds_the_buffers_as_they_are(tmp_path):
    from safetensors.torch import load_file

    model = _tiny_llama(tied=True)
    model.register_buffer("steps", torch.tensor([7, 8]), persistent=True)  # an integer buffer keeps its dtype
    weights = WeightSet(pack_buckets(named_weights(model), bucket_mb=0.001, dtype="bfloat16"))
    assert {b.dtype for b in weights.buckets} == {"bfloat16", "int64"}
    path = tmp_path / "w.safetensors"
    weights.write_safetensors(str(path))
    header_size = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_size % 8 == 0 and json.loads(path.read_bytes()[8:8 + header_size])
    loaded = load_file(str(path))
    assert set(loaded) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert loaded[name].dtype == want.dtype and torch.equal(loaded[name], want), name


def test_a_mapping_of_arrays_is_a_weight_set_and_non_finite_weights_are_named():
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, dtype=np.float32)}
    weights = as_weight_set(arrays)
    assert len(weights.buckets) == 1 and weights.buckets[0].dtype == "float32"
    for name, array in weights.float32_arrays().items():
        np.testing.assert_array_equal(array, arrays[name])
    assert non_finite(weights.buckets[0]) == []
    bad = {"a": torch.zeros(3), "b": torch.tensor([1.0, float("inf")]), "c": torch.tensor([float("nan")])}
    for dtype in ("bfloat16", "float32"):
        (bucket,) = pack_buckets(bad.items(), bucket_mb=None, dtype=dtype)
        assert non_finite(bucket) == ["b", "c"], dtype


@pytest.mark.parametrize("dtype,zero_stage", [("fp32", 3), ("bf16", 3), ("bf16", 1)])
def test_a_publish_sends_buckets_in_the_training_dtype(ray_cluster, tiny_model_path, dtype, zero_stage):
    """A real rank publishes to a real policy store; what a generator fetches equals the rank's weights,
    in its training dtype, in buckets of train.weight_bucket_mb (ZeRO-3 with every parameter partitioned,
    so the walk really gathers)."""
    from operators.workers.train_worker import TrainWorker
    from pipelines.runtime.policy_store import create_policy_store
    from operators.workers.deepspeed_setup import free_port
    from pipelines.runtime.trainer_settings import trainer_settings

    name = f"weights-test-{dtype}-{zero_stage}"
    store = create_policy_store(name)
    cfg = load_config(None, [f"train.dtype={dtype}", f"train.zero_stage={zero_stage}",
                             "train.zero3_persistence_threshold=0", "train.weight_bucket_mb=0.05"])
    worker = TrainWorker(0, 1, free_port(), trainer_settings(cfg, tiny_model_path), store)
    try:
        worker.version = 1
        worker._publish()
        version, ref = store.latest()
        received = fetch(ref)
        width = 2 if dtype == "bf16" else 4
        params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in worker.engine.module.parameters())
        assert version == 1 and len(received.buckets) > 1
        assert {b.dtype for b in received.buckets} == {"bfloat16" if dtype == "bf16" else "float32"}
        assert all(b.nbytes <= 0.05 * 2**20 or len(b.names) == 1 for b in received.buckets)
        expected = worker.state_dict()
        assert received.names() == list(expected)
        assert received.nbytes >= width * params  # tied or not, every state-dict entry travels
        for name_, array in received.float32_arrays().items():
            np.testing.assert_array_equal(array, expected[name_], err_msg=name_)
    finally:
        store.kill()


def test_nan_weights_are_never_published(ray_cluster, tiny_model_path):
    from operators.workers.engine_steps import NonFiniteError
    from operators.workers.train_worker import TrainWorker
    from pipelines.runtime.policy_store import create_policy_store
    from operators.workers.deepspeed_setup import free_port
    from pipelines.runtime.trainer_settings import trainer_settings

    store = create_policy_store("weights-test-nan")
    worker = TrainWorker(0, 1, free_port(), trainer_settings(load_config(None, []), tiny_model_path), store)
    try:
        with torch.no_grad():
            next(worker.engine.module.parameters())[0, 0] = float("nan")
        worker.version = 1
        with pytest.raises(NonFiniteError, match="non-finite weights"):
            worker._publish()
        assert store.version() == 0  # nothing reached the store
    finally:
        store.kill()


# --- the object store, sized from the config ------------------------------------------------------------

def _model_folder(tmp_path, **dims):
    folder = tmp_path / f"model-{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    shape = dict(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True) | dims  # Qwen2.5-1.5B's
    (folder / "config.json").write_text(json.dumps(shape))
    return str(folder)


def test_an_object_store_too_small_for_the_weights_is_refused_with_the_fix(tmp_path):
    from pipelines.runtime.session import check_object_store
    from pipelines.runtime.memory import weight_channel_mb

    folder = _model_folder(tmp_path)
    fp32 = load_config(None, [])
    bf16 = load_config(None, ["train.dtype=bf16", "train.zero_stage=1"])
    need_fp32, need_bf16 = weight_channel_mb(fp32, folder), weight_channel_mb(bf16, folder)
    assert round(need_bf16["policy_mb"] * 2**20 / 2 / 1e9, 2) == 1.54  # 1.54B weights, two bytes each
    assert need_fp32["policy_mb"] == 2 * need_bf16["policy_mb"]
    with pytest.raises(ConfigError) as refused:
        check_object_store(fp32, folder, 512, "local")
    (field, message), = refused.value.problems
    assert field == "ray.object_store_memory_mb"
    assert "512 MB" in message and "at least" in message and "train.dtype: bf16" in message
    check_object_store(bf16, folder, need_bf16["total_mb"] + 1, "local")  # enough: no error
    with pytest.raises(ConfigError, match="ray start --object-store-memory"):
        check_object_store(bf16, folder, need_bf16["total_mb"] - 1, "node 10.0.0.1")


def test_the_running_cluster_object_store_is_checked(ray_cluster, tmp_path):
    """No size given: each live node's object store (one of 512 MB in the test cluster, which runs all)."""
    from pipelines.runtime.session import check_object_store

    with pytest.raises(ConfigError, match="the HF engine pulls each version .* it has 512 MB"):
        check_object_store(load_config(None, []), _model_folder(tmp_path))
    check_object_store(load_config(None, []), _model_folder(tmp_path, num_hidden_layers=1, vocab_size=1000,
                                                            hidden_size=256, intermediate_size=512,
                                                            num_attention_heads=4))


def test_weight_folders_of_engines_that_died_are_removed_and_live_ones_kept(tmp_path):
    """An engine SIGKILLed (Ray's OOM killer) leaves its weight folder, up to two model copies of RAM in
    /dev/shm; the next engine on the machine removes it. A live engine's folder, a young one and a folder
    without an owner lock are kept."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from operators.engines.weight_files import OWNER_LOCK, WEIGHT_DIR_PREFIX, WeightFile, remove_orphan_weight_dirs

    weights = {"w": np.ones((256, 256), dtype=np.float32)}
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, numpy as np\n"
         "from operators.engines.weight_files import WeightFile\n"
         f"f = WeightFile(base={str(tmp_path)!r})\n"
         "print(f.write({'w': np.ones((256, 256), dtype=np.float32)}), flush=True)\n"
         "time.sleep(600)\n"],
        cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, text=True)
    dead_file = Path(child.stdout.readline().strip())
    dead_size = dead_file.stat().st_size + (dead_file.parent / OWNER_LOCK).stat().st_size
    live = WeightFile(base=str(tmp_path))
    live_file = Path(live.write(weights))
    unowned = tmp_path / f"{WEIGHT_DIR_PREFIX}by-another-version"
    unowned.mkdir()
    assert remove_orphan_weight_dirs(str(tmp_path), min_age_s=0) == (0, 0)  # the child is alive: kept
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert remove_orphan_weight_dirs(str(tmp_path)) == (0, 0)  # younger than a minute: kept
    removed, freed = remove_orphan_weight_dirs(str(tmp_path), min_age_s=0)
    assert (removed, freed) == (1, dead_size)
    assert not dead_file.parent.exists() and live_file.is_file() and unowned.is_dir()
    assert (live_file.parent / OWNER_LOCK).is_file()
    live.release(str(live_file))  # loaded: its memory is given back at once
    assert not live_file.exists()
    live.close()
    assert not live_file.parent.exists()
    os.rmdir(unowned)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verified_versions_carry_checksums_that_the_pull_and_the_written_file_are_checked_against(
        ray_cluster, tmp_path, dtype):
    """The object-store plane's checksums (operators/weights/object_store.py): the first version and every
    verify_every-th carry the trainer's sha256 per tensor in their manifest, through a real policy store; the
    receiver checks the pulled bytes against them, and the file an engine writes from them (full weights, or a
    LoRA adapter's folder) is checked byte for byte as stored. A flipped byte is named, not loaded."""
    from operators.engines.adapters import AdapterSpec, write_adapter
    from operators.weights.checksums import digests_of, file_mismatches
    from operators.weights.object_store import ObjectStoreReceiver, ObjectStoreSender, checked_incoming
    from operators.weights.plane import WeightMismatch
    from pipelines.runtime.policy_store import create_policy_store

    model = _tiny_llama(tied=False)
    store = create_policy_store(f"checksums-{dtype}")
    sender, receiver = ObjectStoreSender(store, verify_every=2), ObjectStoreReceiver(store)
    try:
        verified = {}
        for version in (1, 2, 3, 4):
            buckets = list(pack_buckets(named_weights(model), bucket_mb=0.01, dtype=dtype))
            sender.send(version, buckets)
            incoming = receiver.newest(version - 1)
            assert incoming.version == version
            verified[version] = incoming.digests is not None
            if incoming.digests:
                assert incoming.digests == digests_of(buckets)
                assert incoming.checked == len(model.state_dict())
        assert verified == {1: True, 2: False, 3: True, 4: False}  # the first, then every 2nd sent

        _, ref = store.latest()
        import ray

        manifest = ray.get(ref)
        weights = as_weight_set(dict(model.state_dict()))
        digests = digests_of(weights.buckets)
        manifest.digests = dict(digests)
        manifest.digests["model.norm.weight"] = "0" * 64  # the bytes pulled are not what the trainer sent
        with pytest.raises(WeightMismatch, match=r"policy version 4 .*model.norm.weight \(received\)"):
            checked_incoming(4, manifest, weights, 0.0)

        path = str(tmp_path / "version.safetensors")
        weights.write_safetensors(path)
        adapter = write_adapter(str(tmp_path / "adapter"), weights, AdapterSpec(4, 8.0, "all-linear", "base"))
        for written in (path, adapter):
            assert file_mismatches(written, digests) == (len(digests), [])
        with open(path, "r+b") as f:  # one byte of the last tensor's data, flipped on disk
            f.seek(-1, 2)
            last = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([last[0] ^ 1]))
        checked, bad = file_mismatches(path, dict(digests, extra="0" * 64))
        assert checked == len(digests) and bad == [f"{weights.names()[-1]} (written)", "extra (written)"]
    finally:
        store.kill()
