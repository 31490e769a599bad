"""Datasets as users keep them (issue 47, item 2): verl's parquet layout (the prompt as messages, the answer in
`reward_model.ground_truth`, `data_source`, `extra_info`) read through `data.columns`, which makes columns from
fields of record columns; `streamrl validate` and `run` name a mapping that cannot be made, with its row; a job
trains on such a file with a reward function written in TRL's style. And `datasets` datasets: by name from the
Hugging Face cache with HF_HUB_OFFLINE=1 (`hf:NAME`), and folders written by `save_to_disk`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipelines.cli import main

TESTS = Path(__file__).resolve().parents[1]


def verl_parquet(folder: Path, count: int = 24, broken_row: int | None = None) -> str:
    """A file in verl's layout (as its data preprocessing scripts write it), sums of two digits."""
    rows = []
    for i in range(count):
        a, b = i % 10, (3 * i) % 10
        reward_model = {"style": "rule", "ground_truth": str(a + b)}
        if i == broken_row:
            reward_model = {"style": "model", "ground_truth": None}
        rows.append({
            "data_source": "sums_in_verl_layout",
            "prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "ability": "math",
            "reward_model": reward_model,
            "extra_info": {"split": "train", "index": f"sum-{i:03d}"},
        })
    path = folder / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def job_config(folder: Path, tiny: str, data: dict, **sections) -> str:
    tree = {"model": {"path": tiny}, "data": data, "train": {"steps": 2}, "eval": None,
            "tracking": {"enabled": False}, "output_dir": str(folder / "runs"),
            "reward": {"functions": [{"name": "trl_style_rewards:verl_row_seen"}]}, **sections}
    config = folder / "job.yaml"
    config.write_text(yaml.safe_dump(tree))
    return str(config)


VERL_COLUMNS = {"ground_truth": "reward_model.ground_truth", "index": "extra_info.index"}


def test_a_verl_parquet_file_is_read_through_column_mapping(tmp_path, tiny_model_path, capsys):
    from pipelines.config.load import load_config
    from pipelines.data.datasets import load_prompts
    from pipelines.data.inputs import check_inputs

    config = job_config(tmp_path, tiny_model_path, {"path": verl_parquet(tmp_path), "columns": VERL_COLUMNS,
                                                    "id_column": "index"})
    assert main(["validate", config]) == 0, capsys.readouterr().err
    cfg = load_config(config)
    prompts, _ = check_inputs(cfg, print, resolve=True).prompts(cfg.data)
    assert prompts["ground_truth"].tolist()[:3] == ["0", "4", "8"]
    assert prompts["prompt_id"].tolist()[:2] == ["sum-000", "sum-001"]  # the id from extra_info.index
    assert list(prompts["prompt"].iloc[1]) == [{"role": "user", "content": "1+3="}]
    # a file in verl's layout gets `ground_truth` from `reward_model.ground_truth` unasked, beside other mappings too
    for data in ({}, {"columns": {"index": "extra_info.index"}, "id_column": "index"}):
        bare = job_config(tmp_path, tiny_model_path, {"path": verl_parquet(tmp_path), **data})
        assert main(["validate", bare]) == 0, capsys.readouterr().err
        assert load_prompts(load_config(bare).data)[0]["ground_truth"].tolist()[:2] == ["0", "4"]
    # a column the reward function takes that no mapping makes: refused before anything starts
    other = job_config(tmp_path, tiny_model_path, {"path": verl_parquet(tmp_path)},
                       reward={"functions": [{"name": "trl_style_rewards:needs_a_solution_column"}]})
    assert main(["validate", other]) == 2
    err = capsys.readouterr().err
    assert "reward.functions.0.name" in err and "['solution']" in err


def test_a_verl_file_whose_records_lack_the_answer_is_named_with_its_row(tmp_path, tiny_model_path, capsys):
    path = tmp_path / "train.parquet"
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "data_source": "x",
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)} if i != 3 else {"style": "model"}}
            for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    config = job_config(tmp_path, tiny_model_path, {"path": str(path)})
    assert main(["validate", config]) == 0  # parquet fills the missing field of row 3 with null: None for the reward
    rows[3]["reward_model"] = "model-judged"  # a JSON file can hold anything there
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = job_config(tmp_path, tiny_model_path, {"path": str(tmp_path / "train.jsonl")})
    for command in ("validate", "run"):
        assert main([command, config]) == 2
        err = capsys.readouterr().err
        assert "data.columns.ground_truth" in err and "row 3: 'reward_model' is str, not a record" in err, err[-2000:]


@pytest.mark.parametrize("columns, row, field, says", [
    ({"ground_truth": "reward_models.ground_truth"}, None, "data.columns.ground_truth",
     "has no column 'reward_models' for 'ground_truth'"),
    ({"ground_truth": "reward_model.answer"}, None, "data.columns.ground_truth",
     "row 0: 'reward_model' is a record without 'answer' (it has ['ground_truth', 'style'])"),
    ({"ground_truth": "data_source.name"}, None, "data.columns.ground_truth", "row 0: 'data_source' is str, not a record"),
    ({"ground_truth": "reward_model..x"}, None, "data.columns", "is not a column or a dotted path"),
])
def test_validate_and_run_name_a_mapping_that_cannot_be_made(columns, row, field, says, tmp_path, tiny_model_path,
                                                             capsys):
    config = job_config(tmp_path, tiny_model_path, {"path": verl_parquet(tmp_path), "columns": columns})
    for command in ("validate", "run"):
        assert main([command, config]) == 2, command
        err = capsys.readouterr().err
        assert field in err and says in err, (command, err[-2000:])
        assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_a_null_inside_a_record_reaches_the_reward_function(tmp_path, tiny_model_path, capsys):
    """A row whose `reward_model.ground_truth` is null is the reward function's business (TRL-style: None where it
    does not apply), not the check's: the mapping makes None there."""
    from pipelines.config.load import load_config
    from pipelines.data.datasets import load_prompts

    config = job_config(tmp_path, tiny_model_path, {"path": verl_parquet(tmp_path, broken_row=5),
                                                    "columns": VERL_COLUMNS, "id_column": "index"})
    assert main(["validate", config]) == 0, capsys.readouterr().err
    prompts, _ = load_prompts(load_config(config).data)
    assert pd.isna(prompts["ground_truth"].iloc[5]) and prompts["ground_truth"].iloc[6] == "14"


def test_a_job_trains_on_a_verl_file_with_a_trl_style_reward(tmp_path, tiny_model_path):
    """Through the installed command: every sample's reward is 1.0 only if the TRL-style function was handed the
    prompt as messages, the completion as an assistant message, its token ids, the mapped ground truth and the
    data source (tests/trl_style_rewards.py, verl_row_seen)."""
    config = job_config(tmp_path, tiny_model_path, {"path": verl_parquet(tmp_path), "columns": VERL_COLUMNS,
                                                    "id_column": "index"})
    streamrl = str(Path(sys.executable).parent / "streamrl")
    out = subprocess.run([streamrl, "run", config], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(TESTS), "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rewards = [float(value) for value in re.findall(r"^step +\d+/2 \| reward ([-\d.]+)", out.stdout, re.M)]
    assert rewards == [1.0, 1.0], out.stdout[-3000:]
    assert "WARNING reward function" not in out.stderr


# --- datasets' datasets ------------------------------------------------------------------------------------------

def sums_rows(count: int) -> list[dict]:
    return [{"prompt": f"{i % 10}+{(i * 3) % 10}=", "answer": str(i % 10 + (i * 3) % 10)} for i in range(count)]


def cache_named_dataset(home: Path, name: str, splits: dict[str, list[dict]]) -> None:
    """Put `name` in the Hugging Face cache under `home` as `datasets.load_dataset(name)` leaves it after a first
    load while online (HF_HOME/datasets/<owner>___<name>/default/0.0.0/<hash>/<name>-<split>.arrow): built here
    with datasets' own parquet builder from local files, then named as the Hub's copy would be (datasets 5.2.0's
    cache layout: no network here to load one for real)."""
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet

    owner, _, base = name.rpartition("/")
    files = {}
    for split, rows in splits.items():
        files[split] = [str(home / f"{split}.parquet")]
        pq.write_table(pa.Table.from_pylist(rows), files[split][0])
    cache = home / "datasets"
    builder = Parquet(cache_dir=str(cache), dataset_name=base, config_name="default", hash="0123abcd",
                      data_files=DataFilesDict.from_patterns(files))
    builder.download_and_prepare()
    (config_dir,) = (cache / base).glob("default-*")
    config_dir.rename(cache / base / "default")
    if owner:
        (cache / base).rename(cache / f"{owner}___{base}")


def command(tmp_path: Path, *argv: str, home: Path) -> subprocess.CompletedProcess:
    """The installed streamrl, as a user runs it: offline, with the Hugging Face cache under `home`."""
    streamrl = str(Path(sys.executable).parent / "streamrl")
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(TESTS),
           "PYTHONUNBUFFERED": "1"}
    env.pop("HF_DATASETS_CACHE", None)
    return subprocess.run([streamrl, *argv], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)


def test_a_dataset_by_name_from_the_cache_offline_trains_and_a_wrong_split_or_name_is_named(tmp_path, tiny_model_path):
    home = tmp_path / "hf"
    home.mkdir()
    cache_named_dataset(home, "someone/sums", {"train": sums_rows(40), "test": sums_rows(8)})
    config = job_config(tmp_path, tiny_model_path, {"path": "hf:someone/sums"},
                        reward={"functions": [{"name": "arithmetic_exact"}]})
    out = command(tmp_path, "validate", config, home=home)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Using the latest cached version" not in out.stderr  # datasets' notices stay off the terminal
    out = command(tmp_path, "run", config, home=home)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert len(re.findall(r"^step +\d+/2 \| reward", out.stdout, re.M)) == 2
    for sets, says in ((["--set", "data.hf_split=validation"], ["data.path", "Unknown split \"validation\"",
                                                                "data.hf_split"]),
                       (["--set", "data.path=hf:someone/absent"], ["data.path", "'someone/absent'", "HF_HUB_OFFLINE=1",
                                                                    "load it once while online"])):
        out = command(tmp_path, "validate", config, *sets, home=home)
        assert out.returncode == 2 and all(part in out.stderr for part in says), (sets, out.stderr[-2000:])
        assert "Traceback" not in out.stderr


def test_a_save_to_disk_folder_and_its_splits(tmp_path, tiny_model_path, capsys):
    import datasets

    from pipelines.config.load import load_config
    from pipelines.data.datasets import load_prompts

    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(sums_rows(30)),
                          "test": datasets.Dataset.from_list(sums_rows(5))}).save_to_disk(str(folder))
    data = {"path": str(folder), "hf_split": "test"}
    config = job_config(tmp_path, tiny_model_path, data, reward={"functions": [{"name": "arithmetic_exact"}]})
    assert main(["validate", config]) == 0, capsys.readouterr().err
    prompts, _ = load_prompts(load_config(config).data)
    assert prompts["prompt"].tolist() == [row["prompt"] for row in sums_rows(5)]
    for sets, field, says in ((["--set", "data.hf_split=dev"], "data.path", "holds the splits ['test', 'train'], not "
                               "'dev'; set data.hf_split"),
                              (["--set", f"data.path={tmp_path / 'x.jsonl'}"], "data.hf_split",
                               "applies only to hf:NAME datasets and save_to_disk folders")):
        (tmp_path / "x.jsonl").write_text("".join(json.dumps(row) + "\n" for row in sums_rows(3)))
        assert main(["validate", config, *sets]) == 2
        err = capsys.readouterr().err
        assert field in err and says in err, err[-2000:]
    single = tmp_path / "single"
    datasets.Dataset.from_list(sums_rows(7)).save_to_disk(str(single))
    config = job_config(tmp_path, tiny_model_path, {"path": str(single)},
                        reward={"functions": [{"name": "arithmetic_exact"}]})
    assert main(["validate", config]) == 0
    assert len(load_prompts(load_config(config).data)[0]) == 7
