"""The time-to-quality race's machinery on the tiny job (benchmarks/race.py): 2 modes, 1 seed, 2 steps, then the
baseline (the plain synchronous loop) added with --continue (mode 2 is mode default with another max_staleness:
left to the benchmark, so that CI stays under 45 minutes). The record says what each run did
and each mode reached, and the picture is drawn. The race runs as a user runs it, `python
benchmarks/real_model.py race ...` in a process of its own, so each of its jobs and evaluations starts and stops
its own Ray as on a user's machine. The long races are benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--set", "train.steps=2", "--set", "rollout.max_new_tokens=4", "--set", "eval.max_prompts=8"]


def race(tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "benchmarks/real_model.py", "race", "configs/tiny_grpo.yaml", "--seeds", "1",
               "--every", "1", "--name", "tiny", "--results", str(tmp_path), "--scratch", str(tmp_path / "runs"),
               *arguments]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=840, start_new_session=True)


# make test-extended (CI stays under 45 minutes): the race is a benchmark command; its curves, thresholds and
# record fields stay in CI (tests/unit/test_race_curves.py).
@pytest.mark.slow
@pytest.mark.extended
def test_race_records_every_run_and_draws_the_modes(tmp_path):
    done = race(tmp_path, *TINY, "--modes", "0,default")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    record = json.loads((tmp_path / "tiny_race.json").read_text())
    assert record["command"].startswith("python benchmarks/real_model.py race")
    assert [(run["mode"], run["max_staleness"]) for run in record["runs"]] == [("0", 0), ("default", 1)]
    for run in record["runs"]:
        assert run["steps"] == 2 and [p["step"] for p in run["points"]] == [0, 1, 2]
        walls = [p["wall_s"] for p in run["points"]]
        assert walls == sorted(walls) and walls[1] > 0  # start-up counts: step 1 ends after the job started
        assert all(0.0 <= p["accuracy"] <= 1.0 for p in run["points"])
        assert run["points"][0]["accuracy"] == record["step0_accuracy"] == record["step0"]["accuracy"]
        # each step's training figures: what it learned from and how much of the gradient the clip removed
        assert set(run["trained"]) == {"1", "2"}
        for figures in run["trained"].values():
            assert 0.0 <= figures["success_rate"] <= 1.0 and figures["staleness_mean"] >= 0.0
            assert any(key.endswith("clip_fraction") for key in figures), figures
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
    refused = race(tmp_path, "--set", "train.steps=3", "--modes", "0", "--continue")
    assert refused.returncode != 0 and "--set" in refused.stderr, refused.stderr[-3000:]
    assert json.loads((tmp_path / "tiny_race.json").read_text()) == record  # the record is left as it was
    done = race(tmp_path, *TINY, "--modes", "plain", "--continue", "--keep-checkpoints")  # the other modes stay
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    more = json.loads((tmp_path / "tiny_race.json").read_text())
    assert more["runs"][:2] == record["runs"]
    assert [run["mode"] for run in more["runs"]] == ["0", "default", "plain"]
    assert more["step0"] == record["step0"] and len(more["continued"]) == 1
    assert set(more["headline"]) == {"0", "default (1)", "plain loop (sync)"}
    assert [line for line in lines if line.startswith("race: mode ")] == ["race: mode plain, seed 0"]
    # the baseline: the plain loop, scored on the weights it saved at the same steps as the job's checkpoints
    plain = more["runs"][2]
    assert [p["step"] for p in plain["points"]] == [0, 1, 2] and plain["points"][0] == more["runs"][0]["points"][0]
    assert set(plain["trained"]) == {"1", "2"} and 0.0 < plain["step_end_s"]["1"] < plain["step_end_s"]["2"]
    assert sorted(path.name for path in (tmp_path / "runs" / "tiny-plain-s0").iterdir()) == [
        "step-1.safetensors", "step-2.safetensors"]
