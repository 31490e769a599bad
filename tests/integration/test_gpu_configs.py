"""The GPU configs load, their resource plan fits the cluster each one declares, and a trainer
rank's estimated memory fits the GPUs it declares.

They cannot run here (no GPU): this checks what can be checked on a CPU machine. Their
model and prompt paths point at a real cluster's storage, so stand-ins replace them: a model
folder whose config.json has the real model's dimensions (Qwen2.5-0.5B / 1.5B, as the configs
name), and a prompt file; vLLM is swapped for hf only where vLLM is not installed, since the
engine does not change the plan. (Device and backend selection are tested in
tests/integration/test_trainer_device.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from pipelines.config.base import ConfigError
from pipelines.config.load import load_config
from pipelines.config.world import vllm_installed
from pipelines.runtime.resources import declared_nodes, plan_problems, totals

ROOT = Path(__file__).resolve().parents[2]
# Not in configs/ itself: their model and prompt paths exist only on a GPU cluster, so they
# validate here with stand-ins (below), not as they are.
GPU_DIR = ROOT / "configs" / "gpu"
GPU_CONFIGS = {"gpu_1.yaml": 1, "gpu_8.yaml": 8, "gpu_16.yaml": 16, "qwen2.5-7b_8xh100.yaml": 8}
# The dimensions of the models the configs name (their config.json on the Hugging Face hub).
SMALL = dict(vocab_size=151936, num_key_value_heads=2, tie_word_embeddings=True)
QWEN = {"0.5B": dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864, num_attention_heads=14, **SMALL),
        "1.5B": dict(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960, num_attention_heads=12, **SMALL),
        "7B": dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944, num_attention_heads=28,
                   vocab_size=152064, num_key_value_heads=4, tie_word_embeddings=False)}
MODEL_OF = {"gpu_1.yaml": "0.5B", "gpu_8.yaml": "1.5B", "gpu_16.yaml": "1.5B", "qwen2.5-7b_8xh100.yaml": "7B"}


@pytest.fixture(scope="module")
def stand_in_folders(tmp_path_factory) -> dict[str, list[str]]:
    folder = tmp_path_factory.mktemp("stand_ins")
    prompts = folder / "train.parquet"
    pd.DataFrame({"prompt": ["1+1="], "answer": ["2"]}).to_parquet(prompts)
    out = {}
    for size, dims in QWEN.items():
        model = folder / f"qwen2.5-{size}"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"model_type": "qwen2", **dims}))
        # the 7B config's prompts are reasoning-gym's, generated here: only its model stands in
        overrides = [f"model.path={model}"] + ([f"data.path={prompts}"] if size != "7B" else [])
        out[size] = overrides if vllm_installed() else overrides + ["rollout.engine=hf"]
    return out


@pytest.fixture(scope="module")
def stand_ins(stand_in_folders) -> list[str]:
    return stand_in_folders["1.5B"]


def test_every_gpu_config_is_covered():
    assert sorted(p.name for p in GPU_DIR.glob("*.yaml")) == sorted(GPU_CONFIGS)


def test_parameter_count_of_the_named_models():
    from pipelines.runtime.memory import model_shape, parameter_count

    assert round(parameter_count(QWEN["1.5B"]) / 1e9, 2) == 1.54  # Qwen2.5-1.5B: 1.54B
    assert round(parameter_count(QWEN["0.5B"]) / 1e9, 2) == 0.49  # Qwen2.5-0.5B: 0.49B
    assert round(parameter_count(QWEN["7B"]) / 1e9, 2) == 7.62  # Qwen2.5-7B: 7.62B
    assert model_shape(str(GPU_DIR)) is None  # no config.json: no estimate, no refusal


def test_lora_adapters_train_alone_in_the_memory_estimate():
    """train.lora: gradients and optimizer state for the adapters only. Rank 32 on every linear layer of
    Qwen2.5-7B is 80.7M weights, 161 MB in bf16."""
    from pipelines.runtime.memory import lora_parameter_count, parameter_count, trainer_rank_gib

    shape = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
    adapters = lora_parameter_count(shape, 32, "all-linear")
    assert adapters == 80_740_352 and round(2 * adapters / 1e6) == 161
    assert lora_parameter_count(shape, 32, ["q_proj", "v_proj"]) == 28 * 32 * (7168 + 4096)
    common = dict(world_size=8, zero_stage=3, bf16=True, micro_batch_tokens=16384, sequence_length=4096,
                  logits_chunk_tokens=2048, gradient_checkpointing=True)
    full, lora = trainer_rank_gib(shape, **common), trainer_rank_gib(shape, **common, trained=adapters)
    assert lora["optimizer"] == pytest.approx(full["optimizer"] * adapters / parameter_count(shape))
    assert lora["gradients"] == pytest.approx(full["gradients"] * adapters / parameter_count(shape))
    assert lora["weights"] == full["weights"] and lora["activations"] == full["activations"]
    assert lora["head_gradient"] == 0 < full["head_gradient"]


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_config_trainer_memory_fits_and_one_batch_per_step_does_not(name, stand_in_folders):
    """The memory estimate can fail: the same config with the whole rank's step in one micro-batch (the
    default micro_batch_tokens: 0) is refused, naming the fields that fix it."""
    from pipelines.runtime.memory import trainer_memory_problem

    overrides = stand_in_folders[MODEL_OF[name]]
    cfg = load_config(GPU_DIR / name, overrides)
    assert trainer_memory_problem(cfg, cfg.model.path) is None
    with pytest.raises(ConfigError) as err:
        load_config(GPU_DIR / name, overrides + ["train.micro_batch_tokens=0"])
    assert "train.micro_batch_tokens: a rank needs an estimated" in str(err.value)
    assert "gradient_checkpointing" in str(err.value)


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_config_loads_and_fits_its_cluster(name, stand_in_folders):
    stand_ins = stand_in_folders[MODEL_OF[name]]
    cfg = load_config(GPU_DIR / name, stand_ins)  # validation includes the plan check
    gpus = GPU_CONFIGS[name]
    assert sum(group.count * group.num_gpus for group in cfg.ray.cluster) == gpus
    planned = totals(cfg)
    assert planned["GPU"] == gpus  # every GPU used, none asked twice
    assert cfg.rollout.num_actors * cfg.rollout.num_gpus + cfg.train.world_size * cfg.train.num_gpus == gpus
    assert plan_problems(cfg, declared_nodes(cfg.ray.cluster)) == []
    assert cfg.model.trust_remote_code is False
    assert cfg.train.placement != "NONE" and cfg.train.dtype == "bf16"


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_config_refused_on_a_smaller_cluster(name, stand_in_folders):
    """The plan check can fail: one GPU fewer on every node and the config is refused."""
    stand_ins = stand_in_folders[MODEL_OF[name]]
    cfg = load_config(GPU_DIR / name, stand_ins)
    smaller = [group.model_dump() | {"num_gpus": max(group.num_gpus - 1, 0)} for group in cfg.ray.cluster]
    with pytest.raises(ConfigError) as err:
        load_config(GPU_DIR / name, stand_ins + [f"ray.cluster={json.dumps(smaller)}"])
    assert "ray.cluster: " in str(err.value) and "GPU" in str(err.value)


def test_strict_pack_needs_one_node_with_room_for_every_rank(stand_ins):
    """16 GPUs in total are not enough when the 8 ranks must share one node of 4 GPUs."""
    cluster = json.dumps([
        {"count": 1, "num_cpus": 8},
        {"count": 1, "num_cpus": 64, "num_gpus": 8, "resources": {"rollout_node": 8}},
        {"count": 2, "num_cpus": 64, "num_gpus": 4, "resources": {"train_node": 4}},
    ])
    with pytest.raises(ConfigError) as err:
        load_config(GPU_DIR / "gpu_16.yaml", stand_ins + [f"ray.cluster={cluster}"])
    assert "STRICT_PACK puts all 8 ranks" in str(err.value)


def test_plan_of_the_tiny_job_on_two_cpu_nodes():
    """The layout of tests/e2e/test_cluster.py: fits with STRICT_SPREAD; NONE cannot meet across nodes;
    a generate actor asking for a resource no node has is refused by name."""
    from pipelines.runtime.resources import Node

    nodes = [Node("head", {"CPU": 2}), Node("second", {"CPU": 2, "rollout_node": 2})]
    base = ["train.world_size=2", "rollout.n=4", "rollout.resources={rollout_node: 1}"]
    assert plan_problems(load_config(None, base + ["train.placement=STRICT_SPREAD"]), nodes) == []
    (problem,) = plan_problems(load_config(None, base), nodes)
    assert problem.startswith("train.placement: NONE meets the ranks on 127.0.0.1")
    (problem,) = plan_problems(load_config(None, ["rollout.resources={gpu_node: 1}"]), nodes)
    assert problem.startswith("generate needs 1 x {CPU: 0.5, gpu_node: 1} but only 0 fit")
    assert nodes[0].free == {"CPU": 2}  # the caller's nodes are not consumed


@pytest.mark.skipif(not vllm_installed(), reason="tensor parallel is a vLLM setting")
def test_a_tensor_parallel_size_that_cannot_split_the_heads_is_refused(stand_in_folders):
    """Qwen2.5-1.5B has 12 attention heads and 2 key/value heads: TP 4 splits them, TP 8 cannot."""
    tp = ["rollout.vllm.tensor_parallel_size={}", "rollout.num_gpus={}", "rollout.num_actors=1"]
    fits = load_config(GPU_DIR / "gpu_8.yaml", stand_in_folders["1.5B"] + [s.format(4) for s in tp])
    assert fits.rollout.vllm.tensor_parallel_size == 4
    with pytest.raises(ConfigError) as refused:
        load_config(GPU_DIR / "gpu_8.yaml", stand_in_folders["1.5B"] + [s.format(8) for s in tp])
    messages = dict(refused.value.problems)
    assert "12 attention heads" in messages["rollout.vllm.tensor_parallel_size"]
    assert "use one of [1, 2, 4, 6, 12]" in messages["rollout.vllm.tensor_parallel_size"]  # 3: not over 2 kv heads


def test_a_lora_job_that_fits_is_not_refused_by_the_full_fine_tuning_estimate(stand_in_folders):
    """The config check wires train.lora into the estimate: at 20480 tokens per micro-batch gpu_1.yaml's
    Qwen2.5-0.5B rank needs ~42 GiB with full fine-tuning, over its 36, and fits with LoRA (no gradients or
    Adam state for the frozen weights); at 24576 the activations alone are too many either way."""
    overrides = stand_in_folders["0.5B"]
    with pytest.raises(ConfigError, match="train.micro_batch_tokens: a rank needs an estimated"):
        load_config(GPU_DIR / "gpu_1.yaml", overrides + ["train.micro_batch_tokens=20480"])
    load_config(GPU_DIR / "gpu_1.yaml", overrides + ["train.micro_batch_tokens=20480", "train.lora={r: 16}"])
    with pytest.raises(ConfigError, match=r"gradients 0\.0, optimizer 0\.1"):
        load_config(GPU_DIR / "gpu_1.yaml", overrides + ["train.micro_batch_tokens=24576", "train.lora={r: 16}"])
