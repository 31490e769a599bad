"""The day-one failures of a first GPU job that a review of the code path found (issue 45, item 4), each
refused or handled before it costs a run: the CPU venv on a GPU machine, vLLM's V2 model runner, a local
object store of a fixed 512 MB, /dev/shm without room for it or for the engines' weight files, and the
trainer-memory estimate without AdamW's step temporary.

The 7B model is a folder holding only Qwen2.5-7B's config.json (its dimensions on the Hugging Face hub), as in
tests/unit/test_object_store_check.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipelines.config.base import ConfigError
from pipelines.config.load import load_config
from pipelines.runtime.memory import (
    LEAST_OBJECT_STORE_MB, local_object_store_mb, model_shape, object_store_problem, parameter_count, shm_problem,
    trainer_rank_gib, weight_channel_mb,
)
from test_object_store_check import qwen_7b  # noqa: F401 (a fixture: a folder with Qwen2.5-7B's config.json)

ROOT = Path(__file__).resolve().parents[2]
GPU_8 = ROOT / "configs" / "gpu" / "gpu_8.yaml"
GIB, MIB = 2**30, 2**20


def test_an_unset_local_object_store_is_sized_from_what_goes_through_it(qwen_7b):
    """gpu_8.yaml at 7B in bf16, on the object-store plane (GPUs): the fixed 512 MB default refused it; unset,
    the store is the estimate + 25% in whole 64 MB, and the same check then passes."""
    cfg = load_config(GPU_8, qwen_7b + ["ray.object_store_memory_mb=null"])
    folder = cfg.model.path
    need = weight_channel_mb(cfg, folder)
    assert need["copies"] == 3 and cfg.train.dtype == "bf16"  # the versions in flight (no evaluator)
    sized = local_object_store_mb(cfg, folder)
    assert sized % 64 == 0 and need["total_mb"] * 1.25 <= sized < need["total_mb"] * 1.25 + 64
    assert 54_000 < sized < 55_000  # ~55 GB: 3 x 14,526 MB of bf16 weights, 128 MB of blocks, a quarter more
    assert object_store_problem(cfg, folder, sized, "local") is None
    assert "set ray.object_store_memory_mb to at least" in object_store_problem(cfg, folder, 512, "local")
    # set: kept as set (the check above refuses it when too small); no model folder at hand: the least size
    assert local_object_store_mb(load_config(GPU_8, qwen_7b + ["ray.object_store_memory_mb=2048"]), folder) == 2048
    assert local_object_store_mb(cfg, None) == LEAST_OBJECT_STORE_MB
    tiny = load_config(None, [])  # the tiny job: the HF engine's 3 versions of a few MB, the blocks
    assert tiny.ray.object_store_memory_mb is None


def test_a_store_that_dev_shm_has_no_room_for_is_refused_with_the_fix(tmp_path):
    free_mb = shutil.disk_usage("/dev/shm").free / MIB
    assert shm_problem(int(free_mb // 2), chosen=False) is None
    problem = shm_problem(int(free_mb) + 4096, chosen=True)
    field, message = problem.split(": ", 1)
    assert field == "ray.object_store_memory_mb"
    assert "as set" in message and "--shm-size=" in message and "medium: Memory" in message
    assert f"below {free_mb:.0f}" in message or f"below {free_mb - 1:.0f}" in message
    assert shm_problem(10**9, chosen=False, shm=str(tmp_path / "absent")) is None  # no /dev/shm: not Linux


def streamrl(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_validate_and_run_refuse_a_local_store_dev_shm_cannot_hold_before_anything_starts(tmp_path):
    free_mb = shutil.disk_usage("/dev/shm").free / MIB
    too_big = f"ray.object_store_memory_mb={int(free_mb) + 4096}"
    for command in ("validate", "run"):
        result = streamrl(command, "configs/tiny_grpo.yaml", "--set", too_big, "--set", f"output_dir={tmp_path}",
                          "--set", "tracking.enabled=false")
        assert result.returncode == 2, (command, result.stdout[-2000:], result.stderr[-2000:])
        assert "ray.object_store_memory_mb: the local object store" in result.stderr, result.stderr[-2000:]
        assert "/dev/shm" in result.stderr
    assert not any(tmp_path.iterdir())  # run stopped before its run folder or any actor


def test_a_job_asking_for_gpus_from_a_torch_without_cuda_is_refused_naming_the_gpu_venv(qwen_7b):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this check is about a CPU torch; the machine's torch has CUDA")
    result = streamrl("validate", "configs/tiny_grpo.yaml", "--set", "train.num_gpus=1", "--set",
                      "rollout.num_gpus=0.5")
    assert result.returncode == 2
    assert "train.num_gpus: 1 GPU(s) asked for" in result.stderr and "rollout.num_gpus: 0.5 GPU(s)" in result.stderr
    assert ". .venv-gpu/bin/activate" in result.stderr and "make install-gpu" in result.stderr
    # A config written for a declared cluster (the GPU configs) is validated against it on a laptop, not here.
    from pipelines.runtime.session import local_gpu_problems

    assert local_gpu_problems(load_config(GPU_8, qwen_7b), local=True) != []  # run would refuse it here
    declared = streamrl("validate", "configs/tiny_grpo.yaml", "--set", "train.num_gpus=1", "--set",
                        "ray.cluster=[{count: 1, num_cpus: 8, num_gpus: 1}]")
    assert declared.returncode == 0, declared.stderr[-2000:]


def test_the_deploy_guide_activates_the_venv_make_install_gpu_builds():
    makefile = (ROOT / "Makefile").read_text()
    gpu_venv = next(line.split("?=")[1].strip() for line in makefile.splitlines() if line.startswith("GPU_VENV ?="))
    for doc in ("docs/deploy.md", "README.md"):
        assert f". {gpu_venv}/bin/activate" in (ROOT / doc).read_text(), doc
    from operators.common.devices import DeviceError, choose_device

    with pytest.raises(DeviceError, match=f". {gpu_venv}/bin/activate"):
        choose_device(1, cuda_available=False, role="trainer rank 0")


def test_vllm_runs_the_v1_model_runner_unless_the_config_says_v2(qwen_7b):
    from operators.engines.vllm import use_model_runner
    from pipelines.stages import engine_options

    cfg = load_config(None, ["rollout.engine=vllm"])
    assert cfg.rollout.vllm.model_runner == "v1"
    assert engine_options(cfg)["model_runner"] == "v1"
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["rollout.engine=vllm", "rollout.vllm.model_runner=v2"])
    assert refused.value.problems[0][0] == "rollout.vllm.model_runner"
    assert "Triton" in refused.value.problems[0][1]
    assert load_config(GPU_8, qwen_7b + ["rollout.vllm.model_runner=v2"]).rollout.vllm.model_runner == "v2"
    before = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    try:
        use_model_runner("v2")
        assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
        use_model_runner("v1")
        assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    finally:
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        if before is not None:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = before


def test_the_trainer_estimate_counts_adamws_step_temporary(qwen_7b):
    """One fp32 tensor the size of what the optimizer steps: the rank's partition under ZeRO 1-3."""
    shape = model_shape(load_config(GPU_8, qwen_7b).model.path)
    common = dict(zero_stage=3, bf16=True, micro_batch_tokens=4096, sequence_length=4096, logits_chunk_tokens=1024,
                  gradient_checkpointing=True)
    four = trainer_rank_gib(shape, world_size=4, **common)
    assert four["optimizer_step"] == pytest.approx(4 * parameter_count(shape) / 4 / GIB)
    assert 6.9 < four["optimizer_step"] < 7.3  # the review's ~7 GiB a rank
    assert four["optimizer_step"] == pytest.approx(four["optimizer"] / 3)  # 4 of the 12 bytes of bf16 state
    zero0 = trainer_rank_gib(shape, world_size=4, **common | {"zero_stage": 0})
    assert zero0["optimizer_step"] == pytest.approx(4 * four["optimizer_step"])  # not partitioned
    lora = trainer_rank_gib(shape, world_size=4, **common, trained=10**7)
    assert lora["optimizer_step"] == pytest.approx(4 * 10**7 / 4 / GIB)


class SmallShm:
    """Free bytes as a small /dev/shm would report them for one folder; the real figure elsewhere."""

    def __init__(self, small: str, free: int):
        self.small, self.free = small, free

    def __call__(self, folder: str) -> int:
        if os.path.realpath(folder).startswith(os.path.realpath(self.small)):
            return self.free
        return shutil.disk_usage(folder).free


def test_weight_files_go_to_disk_when_dev_shm_has_no_room_and_fail_naming_both_when_neither_has(tmp_path):
    from operators.engines.weight_files import WeightFile, WeightRoomError

    shm, disk = tmp_path / "shm", tmp_path / "disk"
    shm.mkdir(), disk.mkdir()
    weights = {"w": np.ones((256, 1024), dtype=np.float32)}  # 1 MiB
    said: list[str] = []
    roomy = WeightFile(base=str(shm), echo=said.append, disk=str(disk))
    assert Path(roomy.write(weights)).parent.parent == shm and not said
    roomy.close()
    small = WeightFile(base=str(shm), echo=said.append, disk=str(disk), free_bytes=SmallShm(str(shm), 512 * 1024))
    first, second = small.write(weights), small.write(weights)
    assert Path(first).parent.parent == disk and Path(second).parent.parent == disk
    assert len(said) == 1 and f"writes its updates to {disk} (disk)" in said[0]
    from safetensors.numpy import load_file

    assert np.array_equal(load_file(first)["w"], weights["w"])
    small.close()
    assert list(disk.iterdir()) == [] and list(shm.iterdir()) == []  # both folders removed on close
    full = WeightFile(base=str(shm), echo=said.append, disk=str(disk), free_bytes=lambda folder: 1024)
    with pytest.raises(WeightRoomError, match=r"no room for a weight update of 1 MB: .* --shm-size"):
        full.write(weights)
    full.close()
