"""DAPO dynamic sampling: which groups a step keeps (hand-made rewards), config checks, and a real job
whose ledger records every generated group once, each step training the same number of groups."""

from __future__ import annotations

from pathlib import Path

import pytest

from operators.algorithms.step_batch import select_informative
from pipelines.recovery.checkpoint import CheckpointDir
from pipelines.config.base import ConfigError
from pipelines.config.load import load_config
from pipelines.job import run_job

ROOT = Path(__file__).resolve().parents[2]


def groups(*rewards) -> list[dict]:
    return [{"group_uid": f"g{index}", "rewards": list(r)} for index, r in enumerate(rewards)]


def test_keeps_the_first_informative_groups_and_says_why_the_others_were_dropped():
    rows = groups([1, 1], [0, 1], [1, 0], [0, 0], [1, 0])
    kept, dropped = select_informative(rows, 2)
    assert [row["group_uid"] for row in kept] == ["g1", "g2"]
    assert dropped == {"g0": "zero_variance", "g3": "zero_variance", "g4": "surplus"}
    # Too few informative groups: topped up with zero-variance ones, in schedule order.
    kept, dropped = select_informative(rows, 4)
    assert [row["group_uid"] for row in kept] == ["g0", "g1", "g2", "g4"] and dropped == {"g3": "zero_variance"}


def test_dynamic_sampling_config_is_checked_up_front():
    cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", ["algorithm.dynamic_sampling=true"])
    assert cfg.generated_groups_per_step() == 16 and cfg.train.groups_per_step == 8
    assert load_config(None, []).generated_groups_per_step() == 8  # off: what trains is what is generated
    for sets, field in ((["algorithm.dynamic_sampling_groups=6"], "algorithm.dynamic_sampling_groups"),
                        (["algorithm.dynamic_sampling_groups=10"], "algorithm.dynamic_sampling_groups")):
        with pytest.raises(ConfigError) as err:
            load_config(ROOT / "configs" / "tiny_grpo.yaml", ["algorithm.dynamic_sampling=true", *sets])
        assert field in dict(err.value.problems)


@pytest.mark.slow
def test_each_step_trains_informative_groups_and_the_ledger_records_all(ray_cluster, tmp_path):
    steps, train_groups, generated = 6, 4, 8
    cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", [
        f"train.steps={steps}", f"train.groups_per_step={train_groups}", "rollout.groups_per_call=2",
        "algorithm.dynamic_sampling=true", f"algorithm.dynamic_sampling_groups={generated}", "eval=null",
        "tracking.enabled=false", f"output_dir={tmp_path}", "rollout.n=4",
    ])
    result = run_job(cfg, echo=lambda _: None)
    ledger = CheckpointDir.of_run(tmp_path, result.resume_id).latest_valid().ledger()
    assert len(ledger) == steps * generated and ledger["group_uid"].is_unique  # every generated group, once
    assert (ledger.groupby("train_step")["used"].sum() == train_groups).all()
    assert set(ledger.loc[~ledger["used"], "dropped"]) <= {"zero_variance", "surplus"}
    assert ledger.loc[ledger["used"], "dropped"].isna().all()
    metrics = result.metrics
    assert (metrics["dynamic_sampling_zero_variance"] + metrics["dynamic_sampling_surplus"]
            == generated - train_groups).all()
    # The tiny task starts at ~20% success: most groups of 4 samples are all wrong, so some are dropped.
    assert metrics["dynamic_sampling_zero_variance"].sum() > 0
