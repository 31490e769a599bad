"""Every benchmark script's command line answers a bad config as `streamrl run` does (#48): the same `error: ...`
message on stderr, exit code 2, no traceback, nothing started. One entry does it for all of them,
benchmarks/command_line.py's `run_command`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The scripts that take a config, and how to give them one.
CONFIG_ARGS = {
    "real_model.py": ["learn", "{config}"], "race.py": ["{config}"], "measure_job.py": ["{config}"],
    "loop_latency.py": ["{config}"], "eval_cost.py": ["--config", "{config}"], "shared_prompts.py": ["--config", "{config}"],
}


def main_block(script: Path) -> str:
    """The script's `if __name__ == "__main__":` block, or ''."""
    blocks = [node for node in ast.parse(script.read_text()).body
              if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]
    return ast.unparse(blocks[-1]) if blocks else ""


SCRIPTS = sorted(path for path in (ROOT / "benchmarks").glob("*.py") if main_block(path))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_every_entry_point_goes_through_run_command(script):
    assert "run_command(main)" in main_block(script), \
        f"{script.name}: its entry should be `sys.exit(run_command(main))` (benchmarks/command_line.py)"


@pytest.fixture(scope="module")
def bad_config(tmp_path_factory) -> tuple[Path, str]:
    """A config with a bad field, and what `streamrl run` says about it on stderr."""
    config = tmp_path_factory.mktemp("bad") / "bad.yaml"
    config.write_text("train:\n  lr: -1\n")
    done = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", str(config)], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "train.lr" in done.stderr, done.stderr
    return config, done.stderr


@pytest.mark.parametrize("script", sorted(CONFIG_ARGS))
def test_a_bad_config_is_streamrls_message_and_exit_code_2(script, bad_config):
    config, message = bad_config
    args = [arg.format(config=config) for arg in CONFIG_ARGS[script]]
    done = subprocess.run([sys.executable, f"benchmarks/{script}", *args], cwd=ROOT, capture_output=True, text=True)
    assert (done.returncode, done.stderr) == (2, message)
