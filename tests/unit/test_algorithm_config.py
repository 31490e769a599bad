"""The algorithm and update fields of the config: validated up front, mapped to the trainer, fixed on resume."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.config.base import ConfigError
from pipelines.config.load import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_grpo.yaml"


def problems(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    return dict(info.value.problems)


def test_defaults_keep_todays_algorithm():
    cfg = load_config(None)
    algo = cfg.algorithm
    assert (algo.policy_loss, algo.tis, algo.mis, algo.kl_coef, algo.entropy_coef, algo.overlong_buffer) == (
        "ppo_clip", "none", "none", 0.0, 0.0, 0)
    assert (cfg.train.ppo_epochs, cfg.train.mini_batches) == (1, 1)


def test_bad_algorithm_fields_are_all_reported_with_their_fix():
    found = problems([
        "algorithm.tis_cap=0", "algorithm.kl_coef=-0.1", "algorithm.entropy_coef=-1", "algorithm.kl_estimator=k4",
        "algorithm.clip_ratio_c=0.5", "algorithm.mis_low=1.5", "algorithm.mis_high=0.9", "algorithm.tis=tokens",
        "algorithm.overlong_penalty=-1", "algorithm.policy_loss=ppo",
    ])
    assert set(found) == {
        "algorithm.tis_cap", "algorithm.kl_coef", "algorithm.entropy_coef", "algorithm.kl_estimator",
        "algorithm.clip_ratio_c", "algorithm.mis_low", "algorithm.mis_high", "algorithm.tis",
        "algorithm.overlong_penalty", "algorithm.policy_loss",
    }
    assert "use a cap > 0" in found["algorithm.tis_cap"]
    assert "negative; use 0 (off)" in found["algorithm.kl_coef"]
    assert "unknown KL estimator 'k4'; use one of ['k1', 'k2', 'k3']" in found["algorithm.kl_estimator"]
    assert "must be > 1" in found["algorithm.clip_ratio_c"]
    assert "(0, 1]" in found["algorithm.mis_low"] and ">= 1" in found["algorithm.mis_high"]
    assert "decoupled_ppo" in found["algorithm.policy_loss"]  # the valid names are listed


def test_cross_field_problems_name_the_field_and_the_fix():
    # 8 groups x 8 responses / 1 rank = 64 samples per rank: 3 mini-batches cannot split them
    found = problems(["train.mini_batches=3", "algorithm.overlong_buffer=4", "rollout.top_p=0.9"])
    assert set(found) == {"train.mini_batches", "algorithm.overlong_buffer", "rollout.top_p"}
    assert "does not divide the 64 samples per rank" in found["train.mini_batches"]
    assert "[1, 2, 4, 8, 16, 32, 64]" in found["train.mini_batches"]
    assert "(rollout.max_new_tokens = 4); use a buffer below 4" in found["algorithm.overlong_buffer"]
    assert "use top_p: 1.0" in found["rollout.top_p"]
    assert load_config(TINY, ["train.mini_batches=4", "train.ppo_epochs=2", "algorithm.overlong_buffer=2"])


def test_cli_refuses_with_exit_2(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "run", str(TINY), "--set", "algorithm.tis_cap=-1",
         "--set", "algorithm.kl_estimator=kl"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 2, out.stderr
    assert "algorithm.tis_cap" in out.stderr and "algorithm.kl_estimator" in out.stderr
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written


def test_trainer_and_operators_get_the_algorithm():
    from operators.algorithms.correction import CorrectionSettings
    from pipelines.runtime.trainer_settings import (
        advantage_options,
        train_options,
        trainer_settings,
    )

    cfg = load_config(TINY, [
        "algorithm.policy_loss=decoupled_ppo", "algorithm.tis=sequence", "algorithm.tis_cap=1.5",
        "algorithm.mis=geometric", "algorithm.mis_low=0.9", "algorithm.mis_high=1.1", "algorithm.kl_coef=0.05",
        "algorithm.kl_estimator=k1", "algorithm.entropy_coef=0.01", "algorithm.clip_ratio_c=4",
        "train.ppo_epochs=2", "train.mini_batches=4", "algorithm.overlong_buffer=2", "algorithm.overlong_penalty=0.5",
        "algorithm.advantage=reinforce_pp_baseline", "reference={}",
    ])
    settings = trainer_settings(cfg, "model")
    assert settings.correction == CorrectionSettings(tis="sequence", tis_cap=1.5, mis="geometric", mis_low=0.9,
                                                     mis_high=1.1)
    assert (settings.policy_loss, settings.kl_coef, settings.kl_estimator, settings.entropy_coef,
            settings.clip_ratio_c, settings.ppo_epochs, settings.mini_batches) == (
        "decoupled_ppo", 0.05, "k1", 0.01, 4.0, 2, 4)
    assert advantage_options(cfg) == dict(estimator="reinforce_pp_baseline", max_new_tokens=4, overlong_buffer=2,
                                          overlong_penalty=0.5, kl_reward_coef=0.0)
    # REINFORCE++ whitens over the step's trained tokens unless told to weigh responses equally
    assert train_options(cfg) == {"whiten_advantages": "token", "mini_batches": 4}  # 4: ranks get equal sample counts
    by_response = load_config(TINY, ["algorithm.advantage=reinforce_pp_baseline", "algorithm.whiten_over=response"])
    assert train_options(by_response)["whiten_advantages"] == "response"
    assert train_options(load_config(TINY)) == {"whiten_advantages": None, "mini_batches": 1}
    schedule = trainer_settings(load_config(TINY, ["train.lr_warmup_steps=3", "train.lr_schedule=cosine",
                                                   "train.mini_batches=2", "train.steps=10"]), "model").lr_schedule
    assert (schedule.warmup_steps, schedule.total_steps, schedule.kind) == (6, 20, "cosine")  # in optimizer steps


@pytest.mark.parametrize("field", ["algorithm.kl_coef=0.1", "algorithm.tis=token", "train.ppo_epochs=2",
                                   "train.mini_batches=2", "algorithm.policy_loss=decoupled_ppo",
                                   "algorithm.overlong_buffer=1", "algorithm.whiten_over=response"])
def test_a_resumed_run_cannot_change_how_it_learns(field):
    from pipelines.config.load import flatten
    from pipelines.recovery.resume import config_changes

    with_reference = ["reference={}"]  # a KL coefficient needs the reference stage
    saved = flatten(load_config(TINY, with_reference))
    changed = config_changes(saved, load_config(TINY, [*with_reference, field]))
    assert [key for key, _ in changed] == [field.split("=")[0]]


def test_algorithms_get_their_aggregation_and_clip_or_a_refusal(tmp_path):
    """gspo (per-response loss, clip ~3e-4/4e-4) and Dr. GRPO (sum / budget) are defined with their own
    aggregation: left unset, the config chooses it and `streamrl validate` says so; set against it, the
    config is refused (exit 2) with the field and the fix. TIS on gspo's sequence ratio and
    dynamic sampling on a critic's advantages are refused too."""
    def cli(*sets: str):
        args = [sys.executable, "-m", "pipelines.cli", "validate", str(ROOT / "configs" / "tiny_ppo.yaml")]
        return subprocess.run(args + [item for s in sets for item in ("--set", s)], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})

    # tiny_ppo.yaml sets loss_aggregation: token_mean, so gspo's pairing is refused there ...
    refused = cli("algorithm.policy_loss=gspo", "algorithm.clip_eps_high=0.2", "algorithm.tis=sequence")
    assert refused.returncode == 2, refused.stderr
    for field in ("algorithm.loss_aggregation: token_mean does not fit policy_loss gspo",
                  "set loss_aggregation: seq_mean_token_mean", "algorithm.clip_eps_high: 0.2 never clips",
                  "algorithm.tis: sequence"):
        assert field in refused.stderr, refused.stderr
    # ... and where the config leaves them unset (the defaults), gspo brings its own and says so
    cfg = load_config(None, ["algorithm.policy_loss=gspo"])
    assert (cfg.algorithm.loss_aggregation, cfg.algorithm.clip_eps_low, cfg.algorithm.clip_eps_high) == (
        "seq_mean_token_mean", 3e-4, 4e-4)
    assert [line.split(":")[0] for line in cfg.algorithm.chosen()] == [
        "algorithm.loss_aggregation", "algorithm.clip_eps_low", "algorithm.clip_eps_high"]
    (tmp_path / "dr_grpo.yaml").write_text("algorithm:\n  advantage: dr_grpo\n")
    chosen = subprocess.run([sys.executable, "-m", "pipelines.cli", "validate", str(tmp_path / "dr_grpo.yaml")],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert chosen.returncode == 0, chosen.stderr
    assert "streamrl: algorithm.loss_aggregation: seq_mean_token_sum_norm (chosen for advantage dr_grpo" in chosen.stderr
    assert '"loss_aggregation": "seq_mean_token_sum_norm"' in chosen.stdout
    assert load_config(None, ["algorithm.policy_loss=gspo", "algorithm.clip_eps_low=1e-3"]).algorithm.clip_eps_low == 1e-3
    # a saved run's config lists every field: resolved, it validates again unchanged and chooses nothing
    from pipelines.config.job import JobConfig

    again = JobConfig.model_validate(cfg.model_dump())
    assert again.algorithm.model_dump() == cfg.algorithm.model_dump() and again.algorithm.chosen() == []
    found = problems(["algorithm.dynamic_sampling=true", "algorithm.advantage=gae", "critic={}"])
    assert "algorithm.dynamic_sampling" in found and "critic" in found["algorithm.dynamic_sampling"]
