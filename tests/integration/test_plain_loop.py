"""The one-process loop (pipelines/plain_loop.py): three GRPO steps on the tiny model, no Ray."""

from __future__ import annotations

import math
from pathlib import Path

from safetensors.torch import load_file

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
    assert "success rate: first 2 steps" in capsys.readouterr().out
