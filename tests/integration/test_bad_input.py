"""Bad input, end to end: a broken dataset file or invalid prompt rows are reported with the
field and the fix before any Ray actor starts, and a reward function that hangs costs its batch
`on_error` (counted in `reward_timeouts`), not the job."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from operators.stages.reward import Reward
from pipelines.config.base import ConfigError
from pipelines.config.job import JobConfig
from pipelines.config.load import load_config
from pipelines.config.rollout import VLLMOptions
from pipelines.data.datasets import load_prompts
from pipelines.data.prompt_checks import model_context_length, validate_prompts

TESTS_ON_PATH = os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")]))


def config_for(tmp_path: Path, data: dict, **sections) -> JobConfig:
    file = tmp_path / "job.yaml"
    file.write_text(yaml.safe_dump({"data": data, **sections}))
    return load_config(file)


def config_error(call, *args) -> dict[str, str]:
    """The ConfigError's messages by field (a field with several problems gets them joined)."""
    with pytest.raises(ConfigError) as info:
        call(*args)
    problems: dict[str, str] = {}
    for path, message in info.value.problems:
        problems[path] = f"{problems[path]}\n{message}" if path in problems else message
    return problems


def jsonl_lines(count: int) -> list[str]:
    return [json.dumps({"prompt": f"{i % 10}+1=", "answer": str(i % 10 + 1), "qid": f"q{i}"}) for i in range(count)]


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for a reaper counts as exited)."""
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


def wait_gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.1)
    return gone(pid)


# --- unreadable files ----------------------------------------------------------------------


def test_truncated_jsonl_names_the_line(tmp_path):
    lines = jsonl_lines(20)
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(lines[:12]) + "\n" + lines[12][:9])  # a copy cut off inside line 13
    cfg = config_for(tmp_path, {"path": str(data)})  # the config check reads only the first rows
    problems = config_error(load_prompts, cfg.data)
    message = problems["data.path"]
    assert str(data) in message and "line 13 is not valid JSON" in message and "truncated" in message
    assert "export it again" in message  # the fix


def test_corrupt_jsonl_line_found_by_config_validation(tmp_path):
    lines = jsonl_lines(8)
    lines[2] = lines[2].replace('"answer"', "answer")  # not JSON
    lines[5] = "[1, 2]"
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(lines) + "\n")
    problems = config_error(config_for, tmp_path, {"path": str(data)})
    assert "line 3 is not valid JSON" in problems["data.path"] and str(data) in problems["data.path"]
    lines[2] = jsonl_lines(3)[2]  # line 3 fixed: line 6, past the rows the config check reads, is an array
    data.write_text("\n".join(lines) + "\n")
    problems = config_error(load_prompts, config_for(tmp_path, {"path": str(data)}).data)
    assert "line 6 is a JSON list, not an object" in problems["data.path"]


def damaged_parquet(tmp_path: Path) -> Path:
    frame = pd.DataFrame({"prompt": [f"{i}+{i}= please" for i in range(2000)], "answer": [str(2 * i) for i in range(2000)]})
    data = tmp_path / "prompts.parquet"
    frame.to_parquet(data)
    raw = data.read_bytes()
    data.write_bytes(raw[:2000] + b"\0" * 500 + raw[2500:])  # damaged pages, intact footer and schema
    return data


def test_parquet_with_damaged_pages(tmp_path):
    data = damaged_parquet(tmp_path)
    cfg = config_for(tmp_path, {"path": str(data)})  # the schema is still readable
    message = config_error(load_prompts, cfg.data)["data.path"]
    assert str(data) in message and "Corrupt snappy compressed data" in message and "export it again" in message


def test_truncated_parquet(tmp_path):
    data = tmp_path / "prompts.parquet"
    pd.DataFrame({"prompt": ["1+1="] * 100}).to_parquet(data)
    data.write_bytes(data.read_bytes()[:-100])
    message = config_error(config_for, tmp_path, {"path": str(data)})["data.path"]
    assert "cannot read" in message and "magic bytes" in message and "export it again" in message


@pytest.mark.parametrize("content, expected", [
    ('{"prompt": "1+1="}', "it is a JSON dict, not a list of records"),
    ("[1, 2]", "item 0 of the list is a JSON int, not an object"),
    ('[{"prompt": "1+1="}, "2+2="]', "item 1 of the list is a JSON str"),
    ('[{"prompt": "1+1="},\n {"prompt": "2+', "not valid JSON at line 2 column"),
    ('"1+1="', "it is a JSON str"),
])
def test_json_that_is_not_a_list_of_records(tmp_path, content, expected):
    data = tmp_path / "prompts.json"
    data.write_text(content)
    message = config_error(config_for, tmp_path, {"path": str(data)})["data.path"]
    assert expected in message and str(data) in message


def test_json_layouts_that_work(tmp_path):
    records = tmp_path / "records.json"
    records.write_text(json.dumps([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]))
    by_column = tmp_path / "columns.json"
    pd.DataFrame({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}).to_json(by_column)  # pandas' default layout
    for data in (records, by_column):
        prompts, _ = load_prompts(config_for(tmp_path, {"path": str(data)}).data)
        assert prompts["prompt"].tolist() == ["1+1=", "2+2="], data


# --- invalid rows ---------------------------------------------------------------------------


def test_csv_with_an_empty_prompt(tmp_path, tiny_model_path):
    data = tmp_path / "prompts.csv"
    data.write_text("prompt,answer\n1+1=,2\n,4\n3+3=,6\n   ,8\n")
    cfg = config_for(tmp_path, {"path": str(data)})
    prompts, _ = load_prompts(cfg.data)  # readable; the rows are checked together, with the tokenizer
    problems = config_error(validate_prompts, prompts, cfg, tiny_model_path)
    assert set(problems) == {"data.path"}
    message = problems["data.path"]
    assert "1 of 4 rows have no prompt (missing/null value): row 1 " in message
    assert "1 of 4 rows have an empty or whitespace-only prompt: row 3 " in message
    assert "data.invalid_prompts: drop" in message and "fix or remove them (column 'prompt')" in message
    # With drop, the rows load, and validate_prompts removes exactly them and says so.
    cfg = config_for(tmp_path, {"path": str(data), "invalid_prompts": "drop"})
    prompts, _ = load_prompts(cfg.data)
    kept, report = validate_prompts(prompts, cfg, tiny_model_path)
    assert kept["prompt"].tolist() == ["1+1=", "3+3="]
    assert report == {"missing_prompt": ["row-00000001"], "empty_prompt": ["row-00000003"]}


def prompt_rows(tmp_path: Path, rows: list[dict], **data) -> JobConfig:
    file = tmp_path / "prompts.jsonl"
    file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return config_for(tmp_path, {"path": str(file), **data})


def test_empty_too_long_and_duplicate_rows_listed_then_dropped(tmp_path, tiny_model_path):
    # Tiny model: 64 positions; a prompt is 1 (bos) + one token per character; 4 new tokens.
    rows = [
        {"qid": "a", "prompt": "1+1="},
        {"qid": "b", "prompt": ""},
        {"qid": "c", "prompt": "9" * 59},  # 60 tokens + 4 = 64: fits exactly
        {"qid": "d", "prompt": "9" * 60},  # 61 + 4 = 65: too long
        {"qid": "a", "prompt": "2+2="},  # the id of row 0 again
        {"qid": "", "prompt": "3+3="},
        {"qid": "e", "prompt": 12},
        {"qid": "f", "prompt": "4+4="},
    ]
    cfg = prompt_rows(tmp_path, rows, id_column="qid", invalid_prompts="drop")
    prompts, _ = load_prompts(cfg.data)
    kept, report = validate_prompts(prompts, cfg, tiny_model_path)
    assert report == {
        "empty_prompt": ["b"], "not_a_string": ["e"], "too_long": ["d"], "empty_id": ["row 5"], "duplicate_id": ["a"],
    }
    assert kept["prompt_id"].tolist() == ["a", "c", "f"] and kept["prompt"].tolist() == ["1+1=", "9" * 59, "4+4="]

    cfg = prompt_rows(tmp_path, rows, id_column="qid")  # error: every kind of problem listed at once
    problems = config_error(validate_prompts, prompts, cfg, tiny_model_path)
    assert set(problems) == {"data.path"}
    message = problems["data.path"]
    assert len(message.splitlines()) == 5  # one line per kind
    assert "1 of 8 rows have an empty or whitespace-only prompt: 'b' (row 1)" in message
    assert "1 of 8 rows have a prompt that is neither text nor a list of chat messages: 'e' (row 6)" in message
    assert "repeat an id" in message and "'a' (row 4)" in message and "make the ids in column 'qid' unique" in message
    assert "have an empty or missing id: row 5" in message and "give every row an id in column 'qid'" in message
    assert "1 of 8 rows are too long for the model" in message and "'d' (row 3)" in message
    assert "must be at most 64, from the model's max_position_embeddings=64" in message
    assert "the longest prompt has 61 tokens" in message
    assert "lower rollout.max_new_tokens" in message and "data.invalid_prompts: drop" in message

    fine = [rows[0], rows[2], rows[3], rows[7]]  # ids a, c, d, f
    cfg = prompt_rows(tmp_path, fine, id_column="qid")
    prompts, _ = load_prompts(cfg.data)
    message = config_error(validate_prompts, prompts, cfg, tiny_model_path)["data.path"]
    assert "1 of 4 rows are too long for the model" in message and "'d' (row 2)" in message
    assert "must be at most 64, from the model's max_position_embeddings=64" in message
    assert "the longest prompt has 61 tokens" in message
    assert "lower rollout.max_new_tokens" in message and "data.invalid_prompts: drop" in message
    # The same prompt fits with fewer new tokens.
    cfg.rollout.max_new_tokens = 3
    kept, report = validate_prompts(prompts, cfg, tiny_model_path)
    assert report == {} and len(kept) == 4


def test_error_lists_count_and_first_ids(tmp_path, tiny_model_path):
    rows = [{"prompt": "" if i % 2 else f"{i}+1="} for i in range(20)]
    cfg = prompt_rows(tmp_path, rows)
    prompts, _ = load_prompts(cfg.data)
    message = config_error(validate_prompts, prompts, cfg, tiny_model_path)["data.path"]
    assert "10 of 20 rows have an empty or whitespace-only prompt: row 1, row 3, row 5, row 7, row 9, ..." in message


def test_dropping_every_prompt_is_an_error(tmp_path, tiny_model_path):
    cfg = prompt_rows(tmp_path, [{"prompt": "9" * 70}, {"prompt": " "}], invalid_prompts="drop")
    prompts, _ = load_prompts(cfg.data)
    problems = config_error(validate_prompts, prompts, cfg, tiny_model_path)
    assert "all 2 prompts are invalid" in problems["data.invalid_prompts"]
    assert "too long" in problems["data.path"] and "data.invalid_prompts: drop" not in problems["data.path"]


def test_vllm_context_is_the_smaller_of_model_and_max_model_len(tiny_model_path):
    cfg = JobConfig()
    assert model_context_length(cfg, tiny_model_path)[0] == 64
    cfg.rollout = cfg.rollout.model_copy(update={"engine": "vllm", "vllm": VLLMOptions(max_model_len=32)})
    assert model_context_length(cfg, tiny_model_path) == (32, "rollout.vllm.max_model_len=32")
    cfg.rollout.vllm = VLLMOptions(max_model_len=256)
    assert model_context_length(cfg, tiny_model_path)[0] == 64
    prompts = pd.DataFrame({"prompt": ["1" * 20, "1" * 40], "prompt_id": ["short", "long"]})
    cfg.rollout.vllm = VLLMOptions(max_model_len=32)
    cfg.data.invalid_prompts = "drop"
    kept, report = validate_prompts(prompts, cfg, tiny_model_path)
    assert report == {"too_long": ["long"]} and kept["prompt_id"].tolist() == ["short"]


def test_builtin_dataset_is_valid(tiny_model_path):
    cfg = JobConfig()
    prompts, _ = load_prompts(cfg.data)
    kept, report = validate_prompts(prompts, cfg, tiny_model_path)
    assert report == {} and len(kept) == cfg.data.num_prompts


# --- the command line: exit 2, nothing started ------------------------------------------------


def cli(tmp_path: Path, command: str, data: Path, **sections) -> tuple[subprocess.CompletedProcess, float]:
    config = tmp_path / "job.yaml"
    tree = {"data": {"path": str(data)}, "output_dir": str(tmp_path / "runs"), "ray": {"num_cpus": 1}, **sections}
    config.write_text(yaml.safe_dump(tree))
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", command, str(config)],
        check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    return out, time.monotonic() - start


def test_cli_validate_rejects_a_truncated_parquet(tmp_path):
    data = tmp_path / "prompts.parquet"
    pd.DataFrame({"prompt": ["1+1="] * 100}).to_parquet(data)
    data.write_bytes(data.read_bytes()[:-100])
    out, _ = cli(tmp_path, "validate", data)
    assert out.returncode == 2, out.stderr
    assert "data.path" in out.stderr and "magic bytes" in out.stderr and "export it again" in out.stderr


def assert_refused_before_anything_started(out: subprocess.CompletedProcess, seconds: float, tmp_path: Path):
    assert out.returncode == 2, out.stdout + out.stderr
    assert seconds < 60
    assert "Started a local Ray instance" not in out.stdout + out.stderr
    assert not (tmp_path / "runs").exists()  # no run folder, no MLflow database
    assert "Traceback" not in out.stderr


def test_cli_run_rejects_a_truncated_jsonl(tmp_path):
    """run_job loads the prompts before it starts anything; the CLI maps ConfigError to exit code 2."""
    data = tmp_path / "prompts.jsonl"
    lines = jsonl_lines(40)
    data.write_text("\n".join(lines[:30]) + "\n" + lines[30][:11])
    out, seconds = cli(tmp_path, "validate", data)
    assert out.returncode == 2 and "line 31 is not valid JSON" in out.stderr  # validate reads every row, as run does
    out, seconds = cli(tmp_path, "run", data)
    assert_refused_before_anything_started(out, seconds, tmp_path)
    assert "data.path" in out.stderr and "line 31 is not valid JSON" in out.stderr and "export it again" in out.stderr


def test_cli_run_lists_a_too_long_and_an_empty_prompt(tmp_path, tiny_model_path):
    """run_job calls validate_prompts before it starts anything; one run lists every problem."""
    data = tmp_path / "prompts.csv"
    pd.DataFrame({"prompt": ["1+1=", "7" * 70, ""], "answer": ["2", "0", "1"]}).to_csv(data, index=False)
    out, seconds = cli(tmp_path, "run", data)
    assert_refused_before_anything_started(out, seconds, tmp_path)
    assert "2 problem(s)" in out.stderr and "data.invalid_prompts: drop" in out.stderr
    assert "1 of 3 rows are too long for the model" in out.stderr and ": row 1 " in out.stderr
    assert "1 of 3 rows have no prompt (missing/null value): row 2 " in out.stderr


# --- a reward function that hangs ----------------------------------------------------------------


def group_batch(responses: list[list[str]], answers: list[str]) -> pd.DataFrame:
    return pd.DataFrame({
        "prompt_id": [f"p{i}" for i in range(len(answers))], "prompt": ["x"] * len(answers),
        "answer": answers, "responses": responses,
    })


def test_hanging_reward_times_out_and_its_process_is_replaced(capfd):
    reward = Reward([("reward_fixtures:hang_on_seven", 1.0), ("arithmetic_exact", 10.0)], on_error=-1.0, timeout_s=2)
    try:
        assert reward(group_batch([["1"]], ["1"]))["rewards"].tolist() == [[11.0]]
        hung_pid = reward.sandbox.pid
        batch = group_batch([["12", "17"], ["7", "abc"]], ["12", "7"])
        start = time.monotonic()
        out = reward(batch)
        seconds = time.monotonic() - start
        assert 2 <= seconds < 2 + 5, seconds
        # The hung function's samples all get on_error; the other function keeps its real scores.
        assert out["reward_reward_fixtures.hang_on_seven"].tolist() == [[-1.0, -1.0], [-1.0, -1.0]]
        assert out["reward_arithmetic_exact"].tolist() == [[1.0, 0.0], [1.0, 0.0]]
        assert out["rewards"].tolist() == [[9.0, -1.0], [9.0, -1.0]]
        assert out["reward_timeouts"].tolist() == [2, 2] and out["reward_errors"].tolist() == [2, 2]
        warning = capfd.readouterr().err
        assert warning.count("did not answer within 2s") == 1 and "'reward_fixtures:hang_on_seven'" in warning
        assert "4 samples get on_error=-1" in warning
        assert wait_gone(hung_pid, 5)  # SIGKILLed; arithmetic_exact ran in a fresh child
        starts = reward.sandbox.starts
        assert starts == 2

        start = time.monotonic()
        out = reward(group_batch([["12", "3"]], ["12"]))
        assert time.monotonic() - start < 2  # a fresh child (no retry of the hung batch)
        assert out["reward_reward_fixtures.hang_on_seven"].tolist() == [[2.0, 1.0]]
        assert out["reward_timeouts"].tolist() == [0] and out["reward_errors"].tolist() == [0]
        assert reward.sandbox.starts == starts and reward.sandbox.pid != hung_pid
    finally:
        reward.close()


def test_crashing_reward_process_costs_its_batch_only(capfd):
    reward = Reward([("reward_fixtures:exit_on_seven", 1.0)], on_error=-1.0, timeout_s=30)
    try:
        out = reward(group_batch([["12", "17"]], ["12"]))
        assert out["rewards"].tolist() == [[-1.0, -1.0]]
        assert out["reward_errors"].tolist() == [2] and out["reward_timeouts"].tolist() == [0]
        assert "failed: the sandbox process died (exit code 3)" in capfd.readouterr().err
        assert reward(group_batch([["12"]], ["12"]))["rewards"].tolist() == [[1.0]]
    finally:
        reward.close()


@pytest.mark.parametrize("functions", [
    [("arithmetic_exact", 1.0)],
    [("reward_fixtures:flaky_length", 1.0), ("arithmetic_exact", 10.0)],  # raises: per-sample fallback
    [("reward_fixtures:none_for_empty", 2.0)],
    [("reward_fixtures:always_raises", 1.0), ("arithmetic_exact", 1.0)],  # named in reward_raised, in both
])
def test_sandbox_scores_equal_in_process(functions):
    batch = group_batch([["12", "17", "", "1 2"], ["7", "abc", "07", "-7"], ["3", "3x", "33", " 3 "]], ["12", "7", "3"])
    in_process = Reward(functions, on_error=-1.0)(batch)
    sandboxed = Reward(functions, on_error=-1.0, timeout_s=10)
    try:
        out = sandboxed(batch)
    finally:
        sandboxed.close()
    pd.testing.assert_frame_equal(out.drop(columns="time_reward"), in_process.drop(columns="time_reward"))
    assert in_process["reward_timeouts"].tolist() == [0, 0, 0]


def test_sandbox_process_runs_the_function_and_dies_with_its_owner():
    in_process = Reward([("reward_fixtures:process_id", 1.0)])
    assert in_process(group_batch([["1"]], ["1"]))["rewards"].tolist() == [[float(os.getpid())]]
    assert in_process.sandbox is None
    reward = Reward([("reward_fixtures:process_id", 1.0)], timeout_s=10)
    child = int(reward(group_batch([["1"]], ["1"]))["rewards"].iloc[0][0])
    assert child != os.getpid() and child == reward.sandbox.pid
    del reward
    gc.collect()
    assert wait_gone(child, 5)


def test_hanging_reward_inside_ray_data(ray_cluster):
    from ray.data import ActorPoolStrategy

    batch = group_batch([["12", "3"], ["7", "abc"], ["45", "6"]], ["12", "7", "45"])
    start = time.monotonic()
    rows = ray_cluster.data.from_pandas(batch).map_batches(
        Reward,
        fn_constructor_kwargs={
            "functions": [("reward_fixtures:hang_on_seven", 1.0), ("reward_fixtures:process_id", 0.0)],
            "on_error": -1.0, "timeout_s": 2,
        },
        compute=ActorPoolStrategy(size=1), num_cpus=0.5, batch_size=1, batch_format="pandas",
        runtime_env={"env_vars": {"PYTHONPATH": TESTS_ON_PATH}},  # Ray workers import reward_fixtures
    ).to_pandas()
    assert time.monotonic() - start < 60
    rows = rows.sort_values("prompt_id").reset_index(drop=True)
    assert rows["reward_reward_fixtures.hang_on_seven"].tolist() == [[2.0, 1.0], [-1.0, -1.0], [2.0, 1.0]]
    assert rows["reward_timeouts"].tolist() == [0, 2, 0] and rows["reward_errors"].tolist() == [0, 2, 0]
    children = {int(pid) for scores in rows["reward_reward_fixtures.process_id"] for pid in scores}
    assert os.getpid() not in children and len(children) == 2  # one child reused, one after the kill
    # The actor's sandbox children do not outlive the actor pool.
    assert all(wait_gone(pid, 30) for pid in children), children
