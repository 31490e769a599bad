"""A first run prints only streamrl's lines (#48): the tiny job as `make run` runs it (`streamrl run
configs/tiny_grpo.yaml`), shortened to 2 steps, with an empty model cache so that the first build of the tiny
model runs too. Third-party lines (DeepSpeed's accelerator warning, transformers' progress bars, Ray's
core-worker error about actor restarts, MLflow's warnings, ...) are filtered where they start:
pipelines/runtime/quiet.py and operators/common/quiet.py.

A line is streamrl's when it is one of the job's own: `streamrl: ...` (what the driver says) or a step line
(`step    1/2 | reward ...`, pipelines/tracking/progress.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STREAMRL_LINE = re.compile(r"^(streamrl: |step +\d+/\d+ \| )")


def foreign(text: str) -> list[str]:
    return [line for line in text.splitlines() if not STREAMRL_LINE.match(line)]


def test_the_rule_tells_streamrl_lines_from_others():
    assert foreign("streamrl: done; checkpoint x\nstep    2/2 | reward 0.078 | success 0.08\n") == []
    assert foreign("[2026-12-05 13:08:13,448] [WARNING] [real_accelerator.py:213:get_accelerator] Setting "
                   "accelerator to CPU.\nWriting model shards: 100%|###| 1/1\n(GenerateReward pid=1) streamrl: x\n"
                   "\n") == ["[2026-12-05 13:08:13,448] [WARNING] [real_accelerator.py:213:get_accelerator] Setting "
                             "accelerator to CPU.", "Writing model shards: 100%|###| 1/1",
                             "(GenerateReward pid=1) streamrl: x", ""]


def test_a_first_tiny_run_prints_only_streamrl_lines(tmp_path):
    streamrl = Path(sys.executable).with_name("streamrl")  # the console script `make run` runs
    command = [str(streamrl)] if streamrl.exists() else [sys.executable, "-m", "pipelines.cli"]
    # A user's shell: without the DS_ACCELERATOR that tests/conftest.py sets for the test process, and with an
    # empty model cache (a first run: the tiny model is built). The timeout only guards against a hang.
    env = {key: value for key, value in os.environ.items() if key != "DS_ACCELERATOR"}
    done = subprocess.run(
        [*command, "run", "configs/tiny_grpo.yaml", "--set", "train.steps=2", "--set", f"output_dir={tmp_path / 'runs'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=840, start_new_session=True,
        env={**env, "STREAMRL_CACHE": str(tmp_path / "cache")},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "streamrl: done;" in done.stdout and re.search(r"^step +2/2 \| ", done.stdout, re.M)
    others = foreign(done.stdout) + foreign(done.stderr)
    assert others == [], "lines that are not streamrl's:\n" + "\n".join(others)
