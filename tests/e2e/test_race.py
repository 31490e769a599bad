"""The time-to-quality race's machinery on the tiny job (benchmarks/race.py): 2 modes, 1 seed, 2 steps. The
record says what each run did and each mode reached, and the picture is drawn. The long races are benchmarks."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_race_records_every_run_and_draws_the_modes(tmp_path):
    from benchmarks.race import race

    lines = []
    record = race("configs/tiny_grpo.yaml", ["train.steps=2", "rollout.max_new_tokens=4", "eval.max_prompts=8"],
                  ["0", "default"], seeds=1, every=1, name="tiny", results=tmp_path, scratch=tmp_path / "runs",
                  echo=lines.append)
    saved = json.loads((tmp_path / "tiny_race.json").read_text())
    assert saved["runs"] == record["runs"] and saved["command"].startswith("python benchmarks/real_model.py race")
    assert [(run["mode"], run["max_staleness"]) for run in record["runs"]] == [("0", 0), ("default", 1)]
    for run in record["runs"]:
        assert run["steps"] == 2 and [p["step"] for p in run["points"]] == [0, 1, 2]
        walls = [p["wall_s"] for p in run["points"]]
        assert walls == sorted(walls) and walls[1] > 0  # start-up counts: step 1 ends after the job started
        assert all(0.0 <= p["accuracy"] <= 1.0 for p in run["points"])
        assert run["points"][0]["accuracy"] == record["step0_accuracy"] == record["step0"]["accuracy"]
    assert set(record["curves"]) == set(record["headline"]) == {"0", "default (1)"}
    for figures in record["headline"].values():
        assert figures["rise_threshold"] == pytest.approx(record["step0_accuracy"] + 0.15)
        assert len(figures["wall_s_to_target"]) == 1
    picture = tmp_path / "tiny_race.png"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000
    assert any(line.startswith("race: max_staleness 0: to ") for line in lines)
    # scored runs' checkpoints are deleted (8.5 GB a run on the real model) unless kept
    assert not (tmp_path / "runs" / "tiny-0-s0").exists() and not (tmp_path / "runs" / "tiny-default-s0").exists()

    # --continue: the record's runs are kept, only the missing (mode, seed) pair runs; other --set is refused
    with pytest.raises(SystemExit, match="--set"):
        race("configs/tiny_grpo.yaml", ["train.steps=3"], ["0"], seeds=1, every=1, name="tiny", results=tmp_path,
             scratch=tmp_path / "runs", echo=lines.append, resume=True)
    more = race("configs/tiny_grpo.yaml", ["train.steps=2", "rollout.max_new_tokens=4", "eval.max_prompts=8"],
                ["0", "default", "2"], seeds=1, every=1, name="tiny", results=tmp_path, scratch=tmp_path / "runs",
                echo=lines.append, resume=True, keep_checkpoints=True)
    assert more["runs"][:2] == record["runs"] and [run["mode"] for run in more["runs"]] == ["0", "default", "2"]
    assert more["step0"] == record["step0"] and len(more["continued"]) == 1
    assert set(more["headline"]) == {"0", "default (1)", "2"}
    assert sum(line == "race: mode 2, seed 0" for line in lines) == 1 and "race: mode 0, seed 0" in lines
    assert sum(line.startswith("race: mode ") for line in lines) == 3
    assert list((tmp_path / "runs" / "tiny-2-s0").rglob("model.safetensors"))
