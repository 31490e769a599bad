"""The one-process loop (pipelines/plain_loop.py): three GRPO steps on the tiny model, no Ray."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from operators.common.devices import DeviceError
from pipelines.config.load import load_config
from pipelines.plain_loop import DEFAULT_CONFIG, ONE_PROCESS, main, run

PARAMETER = "model.layers.0.mlp.down_proj.weight"


def test_three_steps_train_and_reload_the_engine(tiny_model_path):
    cfg = load_config(DEFAULT_CONFIG, ONE_PROCESS + ["train.steps=3", "train.groups_per_step=2", "rollout.n=4"])
    initial = load_file(str(Path(tiny_model_path) / "model.safetensors"))[PARAMETER]
    seen = []

    def watch(record, generate, worker):
        engine_weight = generate.engine.model.state_dict()[PARAMETER].detach().clone()
        seen.append((record["step"], engine_weight, worker.state_dict()[PARAMETER]))

    lines = []
    records = run(cfg, tiny_model_path, watch=watch, echo=lines.append)

    assert [r["step"] for r in records] == [1, 2, 3]
    assert len(lines) == 3 and lines[0].startswith("step   1")
    assert all(math.isfinite(r["loss"]) for r in records)
    assert all(0.0 <= r["reward_mean"] <= 1.0 and 0.0 <= r["success_rate"] <= 1.0 for r in records)
    step, engine_weight, trainer_weight = seen[0]
    assert step == 1
    assert not engine_weight.equal(initial), "the engine still holds the initial weights after step 1"
    assert engine_weight.numpy().tolist() == trainer_weight.tolist(), "the engine's weights are not the trainer's"


def test_main_runs_from_the_command_line_arguments(tiny_model_path, capsys):
    records = main(["--steps", "2", "--set", "train.groups_per_step=2", "--set", "rollout.n=2"])
    assert [r["step"] for r in records] == [1, 2]
    assert "success rate: first 1 steps" in capsys.readouterr().out  # of 2: the two windows do not overlap


def test_at_zero3_the_engine_built_first_generates_and_one_built_beside_the_rank_is_refused(tiny_model_path):
    """While a ZeRO-3 rank lives in a process, transformers builds every from_pretrained in ZeRO-3 shards: an HF
    engine built then failed on its first forward ("'weight' must be 2-D"). The loop builds its engine first, so
    it runs at ZeRO-3; an engine built beside the live rank is refused, saying what to do; once the rank is gone
    a model builds whole again."""
    import gc

    from operators.engines.hf import HFEngine

    cfg = load_config(DEFAULT_CONFIG, ONE_PROCESS + ["train.steps=1", "train.groups_per_step=2", "rollout.n=4",
                                                     "train.zero_stage=3"])
    refused = []

    def watch(record, generate, worker):
        with pytest.raises(DeviceError, match="the HF engine would be built partitioned.*before the trainer rank"):
            HFEngine(tiny_model_path)
        refused.append(record["step"])

    records = run(cfg, tiny_model_path, watch=watch, echo=lambda line: None)
    assert refused == [1] and math.isfinite(records[0]["loss"]) and records[0]["num_tokens"] > 0
    gc.collect()
    HFEngine(tiny_model_path)  # the rank is gone: whole again
