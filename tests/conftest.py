"""Shared fixtures: one real local Ray cluster for the session, the tiny model built once."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from pipelines.grpo import init_ray

    init_ray(num_cpus=2, object_store_memory_mb=512)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from pipelines.tiny import build_tiny_model

    return str(build_tiny_model())
