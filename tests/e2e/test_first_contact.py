"""First contact (issue 48): every input `streamrl validate` used to accept that a job cannot train on is refused
by `validate` and by `run`'s check before anything starts, with exit 2 and a message naming the field and the
fix. Both commands call one check (pipelines/data/inputs.py); each case runs through both, in this process
(`pipelines.cli.main`), and one through the installed `streamrl` command."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pytest
import yaml

from pipelines.cli import main

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]


@dataclass
class Case:
    """A bad input: the config it is given in (`data` and the other sections), `--set` overrides, and what
    the refusal must say (the field, the fix)."""

    sections: dict = field(default_factory=dict)
    sets: list[str] = field(default_factory=list)
    says: list[str] = field(default_factory=list)
    config_text: str | None = None  # the config file as it is written (YAML cases), instead of `sections`
    config_path: str | None = None  # a path given as the config (a folder)
    env: dict = field(default_factory=dict)  # environment variables set (None: unset) for the case


def rows_file(folder: Path, rows: list, name: str = "prompts.jsonl") -> str:
    path = folder / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def sums(count: int, **extra) -> list[dict]:
    return [{"prompt": f"{i % 10}+{i % 7}=", "answer": str(i % 10 + i % 7), **extra} for i in range(count)]


def with_row(count: int, index: int, row: dict) -> list[dict]:
    rows = sums(count)
    rows[index] = row
    return rows


def model_copy(tiny: str, folder: Path, name: str) -> Path:
    copy = folder / name
    shutil.copytree(tiny, copy)
    return copy


def no_template_model(tiny: str, folder: Path) -> str:
    copy = model_copy(tiny, folder, "no_template")
    (copy / "chat_template.jinja").unlink(missing_ok=True)
    settings = json.loads((copy / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (copy / "tokenizer_config.json").write_text(json.dumps(settings))
    return str(copy)


def messages(*turns: tuple[str, str] | dict) -> list[dict]:
    return [turn if isinstance(turn, dict) else {"role": turn[0], "content": turn[1]} for turn in turns]


def case_(name: str, folder: Path, tiny: str) -> Case:
    """The case `name`, its files made under `folder`."""
    data = lambda rows, **more: {"data": {"path": rows_file(folder, rows), **more}}  # noqa: E731
    invalid = "data.invalid_prompts: drop"
    if name == "jsonl_truncated_last_line_of_50000":
        lines = [json.dumps(row) for row in sums(50_000)]
        path = folder / "big.jsonl"
        path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:10])
        return Case({"data": {"path": str(path)}}, says=["data.path", "line 50000 is not valid JSON", "export it again"])
    if name == "bad_json_line_50_of_100":
        lines = [json.dumps(row) for row in sums(100)]
        lines[49] = lines[49].replace('"answer"', "answer")
        path = folder / "prompts.jsonl"
        path.write_text("\n".join(lines) + "\n")
        return Case({"data": {"path": str(path)}}, says=["data.path", "line 50 is not valid JSON", "export it again"])
    if name == "csv_with_only_a_header":
        path = folder / "prompts.csv"
        path.write_text("prompt,answer\n")
        return Case({"data": {"path": str(path)}}, says=["data.path", "holds no prompts", "at least one row"])
    if name in ("null_prompt_after_row_5", "empty_prompt_after_row_5", "blank_prompt_after_row_5"):
        prompt = {"null": None, "empty": "", "blank": "   "}[name.split("_")[0]]
        return Case(data(with_row(20, 12, {"prompt": prompt, "answer": "1"})),
                    says=["data.path", "row 12", "fix or remove them (column 'prompt')", invalid])
    chat = {"chat_role_human": messages(("human", "1+1=")),
            "chat_without_content": messages({"role": "user"}),
            "chat_ending_with_assistant": messages(("user", "1+1="), ("assistant", "2")),
            "chat_empty": []}
    if name in chat:
        rows = [{"prompt": messages(("user", f"{i}+1=")), "answer": str(i + 1)} for i in range(10)]
        rows[7] = {"prompt": chat[name], "answer": "2"}
        return Case(data(rows), says=["data.path", "malformed chat messages", "row 7", invalid])
    if name == "latin1_byte_in_csv_row_11":
        path = folder / "prompts.csv"
        text = "prompt,answer\n" + "".join(f"{i}+1=,{i + 1}\n" for i in range(20))
        raw = text.encode().replace(b"11+1=", b"11+1= caf\xe9")
        path.write_bytes(raw)
        return Case({"data": {"path": str(path)}},
                    says=["data.path", str(path), "line 13 is not UTF-8 text", "byte 0xe9", "iconv -f latin1"])
    if name == "prompt_longer_than_the_models_context":  # the tiny model: 64 positions
        return Case(data(with_row(10, 8, {"prompt": "1" * 70, "answer": "1"})),
                    says=["data.path", "too long for the model", "max_position_embeddings=64",
                          "lower rollout.max_new_tokens"])
    if name == "prompt_longer_than_vllm_max_model_len":
        return Case(data(with_row(10, 8, {"prompt": "1" * 30, "answer": "1"})),
                    sets=["rollout.engine=vllm", "rollout.vllm.max_model_len=32"],
                    says=["data.path", "too long for the model", "rollout.vllm.max_model_len=32",
                          "lower rollout.max_new_tokens"])
    if name in ("duplicate_ids", "empty_ids"):
        rows = sums(10)
        for i, row in enumerate(rows):
            row["qid"] = f"q{i}"
        rows[6]["qid"] = "q2" if name == "duplicate_ids" else ""
        return Case(data(rows, id_column="qid"),
                    says=["data.path", "row 6", "make the ids in column 'qid' unique" if name == "duplicate_ids"
                          else "give every row an id in column 'qid'"])
    if name in ("parquet_prompt_struct", "parquet_prompt_list_of_strings"):
        path = folder / "prompts.parquet"
        prompt = ({"text": "1+1=", "lang": "en"} if name.endswith("struct") else ["1+1=", "2+2="])
        pd.DataFrame({"prompt": [prompt] * 4, "answer": ["2"] * 4}).to_parquet(path)
        what = "neither text nor a list of chat messages" if name.endswith("struct") else "malformed chat messages"
        return Case({"data": {"path": str(path)}}, says=["data.path", what, "fix or remove them (column 'prompt')"])
    if name == "no_answer_column_for_the_reward":
        return Case(data([{"prompt": f"{i}+1="} for i in range(10)]),
                    says=["reward.functions.0.name", "'arithmetic_exact' takes ['answer']", "add the column"])
    if name == "reward_taking_arguments_the_job_does_not_pass":
        # TRL-style functions work (tests/integration/test_trl_rewards.py); one needing TRL's trainer_state does not
        return Case(data(sums(10)), sets=["reward.functions=[{name: 'reward_fixtures:needs_trainer_state'}]"],
                    says=["reward.functions.0.name", "['trainer_state']", "rename the argument"])
    if name == "reward_taking_no_arguments":
        return Case(data(sums(10)), sets=["reward.functions=[{name: 'os:getcwd'}]"],
                    says=["reward.functions.0.name", "'os:getcwd' takes no argument for the completions",
                          "def score(completions, answer"])
    if name == "chat_template_file_missing":
        return Case(data(sums(10), chat_template=str(folder / "nope.jinja")),
                    says=["data.chat_template", "does not exist", "'auto'"])
    if name == "chat_template_invalid_jinja":
        template = folder / "broken.jinja"
        template.write_text("{% for message in messages %}{{ message['content'] }")
        return Case(data(sums(10), chat_template=str(template)),
                    says=["data.chat_template", "TemplateSyntaxError", "fix the template"])
    if name == "chat_prompts_without_a_chat_template":
        rows = [{"prompt": messages(("user", f"{i}+1=")), "answer": str(i + 1)} for i in range(4)]
        return Case({**data(rows), "model": {"path": no_template_model(tiny, folder)}},
                    says=["data.chat_template", "no chat template", "Jinja template file"])
    if name == "system_prompt_without_a_chat_template":
        return Case({**data(sums(4), system_prompt="Add."), "model": {"path": no_template_model(tiny, folder)}},
                    says=["data.system_prompt", "needs a chat template", "remove data.system_prompt"])
    if name == "model_folder_without_weights":
        copy = model_copy(tiny, folder, "no_weights")
        (copy / "model.safetensors").unlink()
        return Case({**data(sums(4)), "model": {"path": str(copy)}},
                    says=["model.path", "has no weights file", "save_pretrained"])
    if name == "model_needing_its_own_code":
        copy = model_copy(tiny, folder, "custom_code")
        config = json.loads((copy / "config.json").read_text())
        config.update(model_type="my-custom-lm", auto_map={"AutoConfig": "configuration_my.MyConfig"})
        (copy / "config.json").write_text(json.dumps(config))
        return Case({**data(sums(4)), "model": {"path": str(copy)}},
                    says=["model.path", "needs its own Python code", "model.trust_remote_code: true"])
    if name == "hub_id_not_in_the_cache_without_network":
        # HF_HUB_OFFLINE unset; the endpoint refuses connections, as a machine without network does
        return Case({**data(sums(4)), "model": {"path": "nobody-here/not-cached-lm"}},
                    says=["model.path", "nobody-here/not-cached-lm", "hf download"],
                    env={"HF_HUB_OFFLINE": None, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_CACHE": str(folder / "hub")})
    if name == "same_section_twice":
        return Case(config_text=f"train:\n  lr: 0.01\n  steps: 1\ndata:\n  path: {rows_file(folder, sums(4))}\n"
                                "train:\n  checkpoint_every: 5\n",
                    says=["train: given twice, at lines 1 and 6", "keep one"])
    if name == "empty_config_file":
        return Case(config_text="# nothing yet\n", says=["the file is empty", "streamrl run configs/tiny_grpo.yaml"])
    if name == "config_path_is_a_folder":
        return Case(config_path=str(ROOT / "configs"), says=["is a folder, not a YAML file", "tiny_grpo.yaml"])
    if name == "set_into_a_list_by_index":
        return Case(data(sums(4)), sets=["reward.functions.0.name=exact_match"],
                    says=["reward.functions.0.name", "reward.functions is a list",
                          "--set 'reward.functions=[{name: exact_match"])
    raise KeyError(name)


CASES = [
    "jsonl_truncated_last_line_of_50000", "bad_json_line_50_of_100", "csv_with_only_a_header",
    "null_prompt_after_row_5", "empty_prompt_after_row_5", "blank_prompt_after_row_5",
    "chat_role_human", "chat_without_content", "chat_ending_with_assistant", "chat_empty",
    "latin1_byte_in_csv_row_11", "prompt_longer_than_the_models_context", "prompt_longer_than_vllm_max_model_len",
    "duplicate_ids", "empty_ids", "parquet_prompt_struct", "parquet_prompt_list_of_strings",
    "no_answer_column_for_the_reward", "reward_taking_arguments_the_job_does_not_pass", "reward_taking_no_arguments",
    "chat_template_file_missing", "chat_template_invalid_jinja", "chat_prompts_without_a_chat_template",
    "system_prompt_without_a_chat_template", "model_folder_without_weights", "model_needing_its_own_code",
    "hub_id_not_in_the_cache_without_network", "same_section_twice", "empty_config_file",
    "config_path_is_a_folder", "set_into_a_list_by_index",
]


def config_of(case: Case, folder: Path, tiny: str) -> str:
    if case.config_path:
        return case.config_path
    config = folder / "job.yaml"
    if case.config_text is not None:
        config.write_text(case.config_text)
    else:
        tree = {"model": {"path": tiny}, "train": {"steps": 1}, "output_dir": str(folder / "runs"), **case.sections}
        config.write_text(yaml.safe_dump(tree))
    return str(config)


@pytest.mark.parametrize("name", CASES)
def test_validate_and_run_refuse_it_naming_the_field_and_the_fix(name, tmp_path, tiny_model_path, capsys,
                                                                   monkeypatch):
    case = case_(name, tmp_path, tiny_model_path)
    for variable, value in case.env.items():
        monkeypatch.delenv(variable, raising=False) if value is None else monkeypatch.setenv(variable, value)
    monkeypatch.chdir(tmp_path)
    config = config_of(case, tmp_path, tiny_model_path)
    for command in ("validate", "run"):
        sets = [part for item in case.sets for part in ("--set", item)]
        code = main([command, config, *sets])
        err = capsys.readouterr().err
        assert code == 2, (command, err[-3000:])
        for part in case.says:
            assert part in err, (command, part, err[-3000:])
        assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # nothing started: no run folder, no MLflow database
    assert not (tmp_path / "mlruns").exists()


def test_the_streamrl_command_refuses_what_its_reward_function_cannot_score(tmp_path, tiny_model_path):
    """The issue's measured case through the installed command: a dataset without the `answer` column the
    reward function takes used to start a job that trained on on_error (0) and exited 0."""
    case = case_("no_answer_column_for_the_reward", tmp_path, tiny_model_path)
    config = config_of(case, tmp_path, tiny_model_path)
    streamrl = str(Path(sys.executable).parent / "streamrl")
    for command in ("validate", "run"):
        out = subprocess.run([streamrl, command, config], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": str(TESTS)})
        assert out.returncode == 2, (command, out.stdout[-2000:], out.stderr[-2000:])
        for part in case.says:
            assert part in out.stderr, (command, part, out.stderr[-2000:])
        assert "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists()


def test_a_dataset_the_job_can_train_on_is_accepted_by_both_with_the_rows_dropped_as_asked(tmp_path, tiny_model_path,
                                                                                             capsys):
    """The check refuses what is wrong, not what is fine: with invalid_prompts: drop, validate says what run
    drops, and run's check (here, pipelines.data.inputs in-process with resolve=True, as prepare calls it) keeps
    the rest."""
    from pipelines.config.load import load_config
    from pipelines.data.inputs import check_inputs

    rows = sums(30)
    rows[12] = {"prompt": "", "answer": "1"}
    case = Case({"data": {"path": rows_file(tmp_path, rows), "invalid_prompts": "drop"}})
    config = config_of(case, tmp_path, tiny_model_path)
    assert main(["validate", config]) == 0
    assert "would drop 1 empty prompt prompt(s) (data.invalid_prompts: drop), e.g. row-00000012" in \
        capsys.readouterr().err
    cfg = load_config(config)
    lines = []
    inputs = check_inputs(cfg, lines.append, resolve=True)
    prompts, _ = inputs.prompts(cfg.data, lines.append)
    assert len(prompts) == 29 and "row-00000012" not in set(prompts["prompt_id"])
    assert lines == ["streamrl: dropped 1 empty prompt prompt(s) (data.invalid_prompts: drop), e.g. row-00000012"]


@pytest.mark.slow
def test_a_reward_function_that_raises_on_every_sample_stops_the_job_naming_it(tmp_path):
    """A tiny job whose only reward function raises on every sample (it passes the check: its signature takes
    what the rows have) used to train 4 steps on reward 0.000 and exit 0 without a word. Now its first step
    stops the job, untrained, and the terminal says which function and its exception."""
    argv = [str(Path(sys.executable).parent / "streamrl"), "run", str(ROOT / "configs" / "tiny_grpo.yaml"),
            "--set", "reward.functions=[{name: 'reward_fixtures:always_raises'}]", "--set", "train.steps=3",
            "--set", f"output_dir={tmp_path / 'runs'}", "--set", "eval=null", "--set", "tracking.enabled=false"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(TESTS), "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    failed = next(line for line in out.stderr.splitlines() if line.startswith("streamrl: job failed:"))
    assert "reward function 'reward_fixtures:always_raises' raised on every sample of step 1" in failed, failed
    assert "ConnectionError: the judge at http://127.0.0.1:9 refused the connection" in failed, failed
    assert "reward.stop_after_failed_steps" in failed and "the last checkpoint is at step 0" in failed, failed
    assert not re.search(r"^step +1/3", out.stdout, re.M)  # no step was trained
