"""Security defaults that need no server: configs cannot run code, models and dashboards are
not trusted or exposed unless a config says so. (Servers bound to loopback are checked
against real servers in test_cluster.py.)"""

from __future__ import annotations

import pytest

from pipelines.config.base import ConfigError
from pipelines.config.job import JobConfig
from pipelines.config.load import load_config


def test_defaults_trust_nothing_and_expose_nothing():
    cfg = JobConfig()
    assert cfg.model.trust_remote_code is False
    assert cfg.ray.include_dashboard is False and cfg.ray.dashboard_host == "127.0.0.1"


def test_yaml_cannot_construct_python_objects(tmp_path):
    marker = tmp_path / "ran"
    config = tmp_path / "evil.yaml"
    config.write_text(f"train: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(config)
    with pytest.raises(ConfigError):
        load_config(None, [f"train.steps=!!python/object/apply:os.system ['touch {marker}']"])
    assert not marker.exists()
