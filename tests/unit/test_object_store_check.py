"""The object-store check sizes each node's store for what goes through it there (issue 26, 4a).

The nodes are plain dicts shaped like `ray.nodes()` entries for the KubeRay layout of
deploy/rayjob.yaml and configs/gpu/gpu_16.yaml: a CPU head of 32 GiB (Ray's default store: 30%
of it), an 8-GPU rollout node and an 8-GPU train node of 400 GiB. The model folder holds only
Qwen2.5-7B's config.json (its dimensions on the Hugging Face hub)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from pipelines.config.base import ConfigError
from pipelines.config.load import load_config
from pipelines.config.world import vllm_installed
from pipelines.runtime.rollout_settings import weight_plane
from pipelines.runtime.session import check_object_store, stages_on_node

GPU_16 = Path(__file__).resolve().parents[2] / "configs" / "gpu" / "gpu_16.yaml"
GIB = 2**30
QWEN_7B = dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, intermediate_size=18944,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)


def node(address: str, memory_gib: float, store_gib: float | None = None, **resources) -> dict:
    store_gib = 0.3 * memory_gib if store_gib is None else store_gib  # Ray's default: 30% of the memory
    return {"NodeID": address.replace(".", "") * 4, "NodeManagerAddress": address, "Alive": True,
            "Resources": {"memory": 0.7 * memory_gib * GIB, "object_store_memory": store_gib * GIB,
                          f"node:{address}": 1.0, **resources}}


def kuberay(head_store_gib=None, rollout_store_gib=None, train_store_gib=None) -> list[dict]:
    return [node("10.0.0.1", 32, head_store_gib, CPU=8.0),
            node("10.0.0.2", 400, rollout_store_gib, CPU=64.0, GPU=8.0, rollout_node=8.0),
            node("10.0.0.3", 400, train_store_gib, CPU=64.0, GPU=8.0, train_node=8.0),
            node("10.0.0.4", 400, 0.001, CPU=64.0, GPU=8.0, train_node=8.0) | {"Alive": False}]  # gone: ignored


@pytest.fixture(scope="module")
def qwen_7b(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("qwen7b")
    (folder / "config.json").write_text(json.dumps(QWEN_7B))
    prompts = folder / "train.parquet"
    pd.DataFrame({"prompt": ["1+1="], "answer": ["2"]}).to_parquet(prompts)
    # micro-batches that fit an 80 GB rank at 7B (the trainer-memory estimate runs at validation)
    return [f"model.path={folder}", f"data.path={prompts}", "train.gradient_checkpointing=true",
            "train.micro_batch_tokens=4096"]


def test_each_node_may_run_what_its_resources_admit(qwen_7b):
    cfg = load_config(GPU_16, qwen_7b + ["rollout.engine=hf"])
    head, rollout, train, _ = (n["Resources"] for n in kuberay())
    assert stages_on_node(cfg, head) == {"reward", "helpers"}
    assert stages_on_node(cfg, rollout) == {"generate", "reward", "helpers"}
    assert stages_on_node(cfg, train) == {"train", "reward", "helpers"}


@pytest.mark.skipif(not vllm_installed(), reason="rollout.engine: vllm needs vLLM installed")
def test_a_small_cpu_head_no_longer_refuses_a_vllm_job_at_7b(qwen_7b):
    """Each node is checked for what goes through its own store: the head, which only runs reward actors and
    the DAG's helpers, needs room for blocks; before, the smallest store (the head's 9.6 GiB) had to hold 3
    versions of 14 GiB of weights. (On GPUs the weights still go through the GPU nodes' stores until the
    weight plane's NCCL backend is wired: rollout.weight_transfer auto resolves to object_store there.)"""
    cfg = load_config(GPU_16, qwen_7b)
    assert cfg.rollout.engine == "vllm" and cfg.eval is None and cfg.critic is None
    assert weight_plane(cfg) == "object_store"
    check_object_store(cfg, cfg.model.path, nodes=kuberay())  # no error
    # Only the DAG's blocks go through the head's store: 128 MB is enough, 100 MB is not.
    check_object_store(cfg, cfg.model.path, nodes=kuberay(head_store_gib=0.125))
    with pytest.raises(ConfigError) as refused:
        check_object_store(cfg, cfg.model.path, nodes=kuberay(head_store_gib=0.1))
    (field, message), = refused.value.problems
    assert field == "ray.object_store_memory_mb"
    assert message.startswith("about 128 MB goes through the object store of node 10.0.0.1 (which may run helpers, reward): 128 MB for")
    assert "policy weights" not in message and "ray start --object-store-memory` of at least 134217728 bytes" in message


def test_a_small_train_node_still_refuses_the_hf_engine(qwen_7b):
    """The HF engine pulls every version from the store: rank 0's node holds the versions it puts, each
    generate node a copy; the head runs neither and still passes at 9.6 GiB."""
    cfg = load_config(GPU_16, qwen_7b + ["rollout.engine=hf"])
    policy_gib = 7.62e9 * 2 / GIB  # Qwen2.5-7B: 7.62B parameters, bf16
    check_object_store(cfg, cfg.model.path, nodes=kuberay())  # 120 GiB on the GPU nodes, 9.6 GiB on the head
    with pytest.raises(ConfigError) as refused:
        check_object_store(cfg, cfg.model.path, nodes=kuberay(train_store_gib=32, rollout_store_gib=32))
    (train_field, train), (rollout_field, rollout) = sorted(refused.value.problems, key=lambda p: "10.0.0.3" in p[1])[::-1]
    assert train_field == rollout_field == "ray.object_store_memory_mb"
    assert "node 10.0.0.3 (which may run helpers, reward, train)" in train and "node 10.0.0.2" in rollout
    assert "x 3 versions (the HF engine pulls each version from the store)" in train
    need_gib = float(train.split("about ")[1].split(" MB")[0]) / 1024
    assert 3 * policy_gib < need_gib < 3 * policy_gib + 0.2  # three versions and the blocks
    assert "ray start --object-store-memory" in train
    assert "rollout.engine: vllm" not in train  # on GPUs vLLM's weights go through the store too, for now
    # The in-training evaluator's retained versions go through rank 0's store as well: two more.
    prompts = next(o for o in qwen_7b if o.startswith("data.path=")).split("=", 1)[1]
    with_eval = load_config(GPU_16, qwen_7b + ["rollout.engine=hf", f"eval.data.path={prompts}"])
    with pytest.raises(ConfigError, match="x 5 versions"):
        check_object_store(with_eval, cfg.model.path, nodes=kuberay(train_store_gib=4 * policy_gib))


def test_one_local_store_holds_all_of_it(qwen_7b, tmp_path):
    """A local cluster (store size given): one node runs everything."""
    cfg = load_config(GPU_16, qwen_7b + ["rollout.engine=hf"])
    with pytest.raises(ConfigError) as refused:
        check_object_store(cfg, cfg.model.path, 32 * 1024, "local")
    (field, message), = refused.value.problems
    assert field == "ray.object_store_memory_mb" and "set ray.object_store_memory_mb to at least" in message
    check_object_store(cfg, cfg.model.path, 45 * 1024, "local")
