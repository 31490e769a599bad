"""Shared fixtures (one real local Ray cluster for the session, the tiny model built once) and the
folder markers.

The folders say what a test covers and what it needs:
  tests/unit/         pure functions and single classes in one process: no Ray, no job (seconds)
  tests/integration/  one room against real parts: Ray actors, vLLM, DeepSpeed ranks, an MLflow server
  tests/e2e/          whole jobs as a user runs them (`streamrl run`, resume, faults, clusters)
Each test gets the marker of its folder (`pytest -m unit`, `-m "not e2e"`); `slow`, `vllm` and
`extended` stay per test.
"""

from __future__ import annotations

import os
import sys
import shutil
import tempfile
from pathlib import Path

import pytest

FOLDER_MARKERS = ("unit", "integration", "e2e")

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from pipelines.runtime.session import init_ray

    init_ray(num_cpus=2, object_store_memory_mb=512)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from pipelines.data.tiny_build import build_tiny_model

    return str(build_tiny_model())


@pytest.fixture(scope="module")
def servers():
    """Processes started in sessions of their own (benchmarks/real_servers.py), all killed at the module's end."""
    from benchmarks.real_servers import Sessions

    # Short path: Ray's unix sockets live under the temp dir and paths must stay < 108 bytes.
    folder = Path(tempfile.mkdtemp(prefix="srl-", dir="/tmp"))
    sessions = Sessions(folder)
    try:
        yield sessions
    finally:
        try:
            sessions.stop()
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = item.path.parent.name
        if folder in FOLDER_MARKERS:
            item.add_marker(folder)


@pytest.fixture(autouse=True)
def no_zero3_left_behind():
    """A ZeRO-3 rank built in this process leaves two things behind that a job never meets (each rank is its
    own process there): transformers builds every later model inside deepspeed.zero.Init while the rank's
    HfDeepSpeedConfig lives (operators/workers/deepspeed_setup.py zero3_init), and DeepSpeed's zero.Init
    leaves torch.nn.functional.linear replaced by its zero3_linear_wrap. Undo both for the tests after."""
    import torch

    linear = torch.nn.functional.linear
    yield
    if "deepspeed" not in sys.modules:  # nothing to undo, and no reason to import transformers
        return
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    torch.nn.functional.linear = linear
