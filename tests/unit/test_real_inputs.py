"""Real-sized and real-shaped inputs, found before any actor starts: the schedule of a GPU config over a
GSM8K-sized dataset, empty datasets, column names that collide with streamrl's, groups of one response,
and numbers that are not finite."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pandas as pd
import pytest

from pipelines.config.base import ConfigError
from pipelines.config.load import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_schedule_copies_the_dataset_once_per_epoch_at_real_sizes():
    """configs/gpu/gpu_8.yaml's 500 steps x 64 groups over 7,473 prompts (GSM8K's train split): 32,000 groups
    in 5 epochs (each prompt once per epoch, the last one cut short), built in well under 100 MB. Copying
    the dataset once per group made 32,000 shuffled copies (239M rows) and ran the driver out of memory."""
    from pipelines.dag import schedule_groups

    cfg = load_config(None, ["train.steps=500", "train.groups_per_step=64", "rollout.groups_per_call=8"])
    rows = 7473
    prompts = pd.DataFrame({"prompt": [f"question {i} " * 20 for i in range(rows)],
                            "prompt_id": [f"gsm8k-{i:05d}" for i in range(rows)], "answer": [str(i) for i in range(rows)]})
    tracemalloc.start()
    try:
        schedule = schedule_groups(prompts, cfg)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100 * 2**20, f"peak {peak / 2**20:.0f} MiB"
    table = pd.concat(schedule, ignore_index=True)
    assert len(schedule) == 32000 // 8 and all(len(call) == 8 for call in schedule)
    assert len(table) == 32000 and table["group_uid"].is_unique
    assert table["train_step"].tolist() == [i // 64 for i in range(32000)]
    assert table["epoch"].max() == 4  # ceil(32000 / 7473) = 5 epochs
    for epoch, part in table.groupby("epoch"):
        assert part["prompt_id"].is_unique  # each prompt once per epoch
        assert len(part) == (rows if epoch < 4 else 32000 - 4 * rows)


def _job(tmp_path: Path, frame: pd.DataFrame, *sets: str, suffix: str = ".jsonl"):
    file = tmp_path / f"prompts{suffix}"
    if suffix == ".parquet":
        frame.to_parquet(file)
    else:
        frame.to_json(file, orient="records", lines=True)
    return load_config(None, [f"data.path={file}", f"output_dir={tmp_path}", *sets])


def test_an_empty_dataset_is_refused(tmp_path, tiny_model_path):
    from pipelines.data.datasets import load_prompts
    from pipelines.data.prompt_checks import validate_prompts

    empty = pd.DataFrame({"prompt": pd.Series([], dtype=str)})
    with pytest.raises(ConfigError, match=r"data.path: .*holds no prompts \(no rows\)"):  # .jsonl: not even columns
        _job(tmp_path, empty)
    cfg = _job(tmp_path, empty, f"model.path={tiny_model_path}", suffix=".parquet")  # a header, no rows
    prompts, _ = load_prompts(cfg.data)
    with pytest.raises(ConfigError, match=r"data.path: .*holds no prompts \(0 rows\); give a dataset with at least one"):
        validate_prompts(prompts, cfg, tiny_model_path)


def test_columns_that_collide_with_streamrls_are_refused_with_the_fix(tmp_path):
    """A `prompt` column beside another prompt_column used to give two `prompt` columns and an AttributeError;
    reserved names (prompt_id, epoch, train_step, group_uid, ...) were silently overwritten."""
    frame = pd.DataFrame({"question": ["1+1="], "prompt": ["unused"], "epoch": [3], "group_uid": ["g"]})
    with pytest.raises(ConfigError) as info:
        _job(tmp_path, frame, "data.prompt_column=question")
    found = dict(info.value.problems)
    assert "has a column 'prompt' besides the prompt column 'question'" in found["data.prompt_column"]
    assert "['epoch', 'group_uid']" in found["data.path"] and "rename them" in found["data.path"]
    # the id column may be called prompt_id: it is the id
    ok = _job(tmp_path, pd.DataFrame({"prompt": ["1+1="], "prompt_id": ["a"]}), "data.id_column=prompt_id")
    assert ok.data.id_column == "prompt_id"
    with pytest.raises(ConfigError, match="set data.id_column: prompt_id"):
        _job(tmp_path, pd.DataFrame({"prompt": ["1+1="], "prompt_id": ["a"]}))


def test_one_response_per_prompt_and_non_finite_numbers_are_refused():
    """n: 1 under a group estimator trains on advantages that are all 0; YAML's .nan / .inf were accepted."""
    with pytest.raises(ConfigError, match=r"rollout.n: 1 response per prompt gives every response advantage 0 under "
                                          r"algorithm.advantage rloo .* sample n >= 2"):
        load_config(None, ["rollout.n=1", "algorithm.advantage=rloo"])
    with pytest.raises(ConfigError) as info:
        load_config(None, ["reward.success_threshold=.nan", "train.lr=.inf"])
    found = dict(info.value.problems)
    assert set(found) == {"reward.success_threshold", "train.lr"}
    assert found["reward.success_threshold"] == "nan is not a finite number; give a finite value"
    with pytest.raises(ConfigError, match=r"reward.functions.0.weight: inf is not a finite number"):
        load_config(None, ["reward.functions=[{name: exact_match, weight: .inf}]"])
    with pytest.raises(ConfigError, match=r"reward.on_error: nan is not a finite number"):
        load_config(None, ["reward.on_error=.nan"])
    assert load_config(None, ["rollout.n=1", "algorithm.advantage=gae", "critic={}"]).rollout.n == 1


def _broken_copy(source: str, tmp_path: Path, name: str) -> Path:
    import shutil

    folder = tmp_path / name
    shutil.copytree(source, folder)
    return folder


def test_a_broken_model_folder_is_named_with_the_fix_before_anything_starts(tmp_path, tiny_model_path, capsys):
    """config.json that is not JSON or that transformers cannot read, a tokenizer that does not load, and one
    without the special tokens the engines need: `streamrl validate` exits 2 naming each; a job refuses the
    folder the same way before any actor starts (the same check, pipelines/data/inputs.py)."""
    import json

    from pipelines.data.inputs import check_inputs
    from pipelines.data.models import model_folder_problems

    assert model_folder_problems(tiny_model_path) == []
    not_json = _broken_copy(tiny_model_path, tmp_path, "not_json")
    (not_json / "config.json").write_text('{"model_type": "llama",')  # cut short
    unknown = _broken_copy(tiny_model_path, tmp_path, "unknown_type")
    (unknown / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    no_tokenizer = _broken_copy(tiny_model_path, tmp_path, "no_tokenizer")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / file).unlink()
    no_specials = _broken_copy(tiny_model_path, tmp_path, "no_specials")
    settings = json.loads((no_specials / "tokenizer_config.json").read_text())
    for key in ("bos_token", "eos_token", "pad_token"):
        settings.pop(key)
    (no_specials / "tokenizer_config.json").write_text(json.dumps(settings))

    expected = {not_json: ["config.json' is not valid JSON", "restore it"],
                unknown: ["transformers cannot read", "no-such-architecture"],
                no_tokenizer: ["the tokenizer in", "does not load", "tokenizer.save_pretrained(folder)"],
                no_specials: ["neither a pad nor an eos token", "neither a bos nor an eos token",
                              "tokenizer.eos_token ="]}
    from pipelines.cli import main

    for folder, parts in expected.items():
        code = main(["validate", str(ROOT / "configs" / "tiny_grpo.yaml"), "--set", f"model.path={folder}"])
        err = capsys.readouterr().err
        assert code == 2, (folder.name, err[-2000:])
        assert "model.path:" in err
        for part in parts:
            assert part in err, (folder.name, part, err)
    with pytest.raises(ConfigError, match="does not load"):
        check_inputs(load_config(ROOT / "configs" / "tiny_grpo.yaml", [f"model.path={no_tokenizer}"]), resolve=True)


def test_corrupt_metadata_is_named_and_does_not_hide_the_other_runs(tmp_path):
    """A malformed checkpoint manifest is skipped like a damaged checkpoint; one unreadable run.json does not
    break `--resume latest` for the other runs, and resuming or evaluating that run says which file is bad;
    'latest' follows the runs' sequence numbers, not the drivers' clocks."""
    import json

    from pipelines.recovery.checkpoint import CheckpointDir, CheckpointError, next_run_sequence, verify
    from pipelines.evaluation.job import EvalError, eval_config
    from pipelines.recovery.resume import check_can_resume, resolve_run, run_file_info

    cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", [f"output_dir={tmp_path}"])
    first, second, torn = (CheckpointDir.of_run(tmp_path, name) for name in ("run-a", "run-b", "run-c"))
    # run-a started later by its driver's clock (a skewed node), but run-b was started after it
    first.write_run_file(run_file_info(cfg, "run-a", "d", started_at=2e9, sequence=next_run_sequence(tmp_path)))
    second.write_run_file(run_file_info(cfg, "run-b", "d", started_at=1e9, sequence=next_run_sequence(tmp_path)))
    assert json.loads((second.root / "run.json").read_text())["sequence"] == 1
    torn.root.mkdir(parents=True)
    (torn.root / "run.json").write_text('{"run_id": "run-c", "con')
    assert resolve_run(tmp_path, "latest") == "run-b"
    with pytest.raises(ConfigError, match=r"run-c/run.json is unreadable .*restore it from a copy"):
        check_can_resume(cfg, torn, None, [], "d")

    for step, manifest in ((1, None), (2, ["not", "a", "manifest"])):
        tmp = second.begin(step)
        second.commit(tmp, step, {"policy_version": step}, pd.DataFrame(columns=["train_step"]))
        if manifest is not None:
            (second.root / f"step_{step:06d}" / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="MANIFEST.json is unreadable"):
        verify(second.root / "step_000002")
    skipped = []
    assert second.latest_valid(echo=skipped.append).step == 1 and "MANIFEST.json is unreadable" in skipped[0]

    class Torn:  # a checkpoint of run-c as eval_config reads it
        path = torn.root / "step_000001"

    Torn.path.mkdir()
    (Torn.path / "config.json").write_text("{}")
    with pytest.raises(EvalError, match="run-c/run.json is unreadable"):
        eval_config(Torn())


def test_run_ids_are_checked_before_they_become_paths_and_eval_never_trusts_the_checkpoints_code(tmp_path):
    import json

    from pipelines.recovery.checkpoint import CheckpointDir
    from pipelines.evaluation.job import EvalError, eval_config
    from pipelines.tracking.lineage import LineageError, find_run_dir
    from pipelines.recovery.resume import resolve_run, run_file_info

    for bad in ("../../etc", "/tmp/x", "..", "a/b", ""):
        with pytest.raises(ConfigError, match="is not a run id"):
            resolve_run(tmp_path, bad)
        with pytest.raises(LineageError, match="is not a run id"):
            find_run_dir(bad, str(tmp_path))
    cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", [f"output_dir={tmp_path}"])
    run = CheckpointDir.of_run(tmp_path, "local-20261203-064013-1a2b3c")
    info = run_file_info(cfg, run.root.name, "d", 1.0)
    info["config"]["model.trust_remote_code"] = True  # what a checkpoint from elsewhere could say
    run.write_run_file(info)
    assert resolve_run(tmp_path, run.root.name) == run.root.name

    class Step:  # a checkpoint of that run, as eval_config reads it
        path = run.root / "step_000001"

    Step.path.mkdir()
    (Step.path / "config.json").write_text(json.dumps({}))
    assert eval_config(Step(), data="builtin:arithmetic-heldout").model.trust_remote_code is False
    assert eval_config(Step(), data="builtin:arithmetic-heldout",
                       overrides=["model.trust_remote_code=true"]).model.trust_remote_code is True


def test_a_run_saved_before_a_field_existed_resumes_with_that_field_at_its_default():
    from pipelines.config.load import flatten
    from pipelines.recovery.resume import config_changes

    cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml")
    saved = flatten(cfg)
    saved.pop("algorithm.whiten_over")  # a run saved before algorithm.whiten_over existed
    assert config_changes(saved, cfg) == []
    changed = load_config(ROOT / "configs" / "tiny_grpo.yaml", ["algorithm.whiten_over=response"])
    assert [key for key, _ in config_changes(saved, changed)] == ["algorithm.whiten_over"]
