"""`streamrl plan` works out what a config needs from a cluster without one (issue 45, item 5): on the 7B
GPU config (Qwen2.5-7B's dimensions from its config.json on the Hugging Face hub, given with --model-config as a
user without the weights would) and on the tiny CPU config. It fits 8 x 80 GB, and says what does not fit on
less."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines.cli import main

ROOT = Path(__file__).resolve().parents[2]
QWEN_7B_CONFIG = ROOT / "configs" / "gpu" / "qwen2.5-7b_8xh100.yaml"
QWEN_7B = dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, intermediate_size=18944,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)


@pytest.fixture
def qwen_7b_config(tmp_path, monkeypatch) -> str:
    """Qwen2.5-7B's config.json alone; and the Hub allowed, so that its id, in no cache here, is not refused
    (a plan is made where the model is not: nothing is downloaded to make one)."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN_7B))
    return str(path)


def plan(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_7b_config_fits_eight_80gb_gpus_and_the_plan_says_where_everything_goes(capsys, qwen_7b_config):
    code, text, err = plan(capsys, str(QWEN_7B_CONFIG), "--gpus", "8", "--gpu-memory-gb", "80",
                           "--model-config", qwen_7b_config)
    assert code == 0, err
    assert "7.62B parameters" in text and "fits." in text
    assert "train x4, generate x4" in text  # every GPU actor on the one node
    assert "trainer rank (1 GPU):" in text and "of 72 GiB" in text and "optimizer_step 7.1" in text
    assert "vLLM engine (1 GPU): 68.0 GiB share: weights 14.2 GiB" in text
    assert "weight plane: object_store" in text and "issue 45" in text
    code, raw, _ = plan(capsys, str(QWEN_7B_CONFIG), "--gpus", "8", "--gpu-memory-gb", "80",
                        "--model-config", qwen_7b_config, "--json")
    record = json.loads(raw)
    assert code == 0 and record["problems"] == []
    train = record["gpus"]["train"]
    assert sum(train["parts"].values()) == pytest.approx(train["per_rank_gib"]) and train["per_rank_gib"] < 72
    node = record["nodes"][0]
    assert node["actors"] == {"train": 4, "generate": 4, "helpers": 1}
    policy_mb = 2 * 7_615_616_512 / 2**20  # bf16
    assert node["object_store_mb"] == pytest.approx(3 * policy_mb + 128)  # 3 versions in flight, the DAG's blocks
    assert node["dev_shm_mb"] == pytest.approx(node["object_store_mb"] + 4 * policy_mb)  # + a file per engine


def test_what_does_not_fit_is_named_and_exits_2(capsys, qwen_7b_config):
    code, text, _ = plan(capsys, str(QWEN_7B_CONFIG), "--gpus", "8", "--gpu-memory-gb", "40",
                         "--model-config", qwen_7b_config)
    assert code == 2 and "does not fit:" in text
    assert "train: a rank needs an estimated 48.9 GiB of 36 GiB" in text
    assert "rollout.vllm.gpu_memory_utilization" not in text  # 0.85 x 40 GB still holds 14.2 GiB of weights
    code, _, err = plan(capsys, str(QWEN_7B_CONFIG), "--gpus", "4", "--gpu-memory-gb", "80",
                        "--model-config", qwen_7b_config)
    assert code == 2 and "ray.cluster" in err and "only 0 fit" in err  # the placement check of validation
    code, _, err = plan(capsys, str(QWEN_7B_CONFIG), "--gpus", "8")
    assert code == 2 and "--model-config" in err  # a Hub id not in the cache: where to get its dimensions


def test_the_tiny_config_plans_on_a_two_cpu_machine(capsys, tiny_model_path):
    code, text, err = plan(capsys, "configs/tiny_grpo.yaml", "--set", f"model.path={tiny_model_path}",
                           "--gpus", "0", "--cpus", "2")
    assert code == 0, err
    assert "no GPU actors" in text and "fits." in text
    assert "train x1, generate x1, eval x1, helpers x1" in text
    assert "weight plane: object_store (the engines pull each version" in text
    code, _, err = plan(capsys, "configs/tiny_grpo.yaml", "--set", f"model.path={tiny_model_path}", "--gpus", "0",
                        "--cpus", "1")
    assert code == 2 and "only 0 fit" in err
    code, _, err = plan(capsys, "configs/tiny_grpo.yaml", "--set", f"model.path={tiny_model_path}")
    assert code == 2 and "no cluster to plan on" in err
