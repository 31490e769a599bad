"""Fault points are a value the driver builds from its environment and passes to the stages: unarmed by
default, armed points hold once per folder, other points pass."""

from __future__ import annotations

import json

from operators.common.faults import FaultPoints


def test_unarmed_without_the_variables_and_armed_points_fire_once(tmp_path):
    assert FaultPoints.from_environment({}) == FaultPoints()
    FaultPoints().reach("rollout_paused")  # unarmed: nothing written, no hold
    armed = FaultPoints.from_environment({"STREAMRL_FAULT_DIR": str(tmp_path), "STREAMRL_FAULT_POINTS": "a, b",
                                          "STREAMRL_FAULT_HOLD_S": "0"})
    assert armed == FaultPoints(str(tmp_path), ("a", "b"), 0.0)
    armed.reach("c")  # not named: passes
    armed.reach("a", version=3)
    armed.reach("a", version=4)  # once per folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]
    assert json.loads((tmp_path / "a.json").read_text())["version"] == 3


def test_a_behaviour_fault_fires_once_without_holding(tmp_path):
    assert not FaultPoints().fires("engine_ignores_update")
    armed = FaultPoints(str(tmp_path), ("engine_ignores_update",), hold_s=3600)  # fires() never holds
    assert not armed.fires("rollout_paused")
    assert armed.fires("engine_ignores_update", version=1)
    assert not armed.fires("engine_ignores_update", version=2)
    assert json.loads((tmp_path / "engine_ignores_update.json").read_text())["version"] == 1
