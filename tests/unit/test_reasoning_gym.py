"""reasoning_gym:<task> prompt datasets (pipelines/data/reasoning_tasks.py), the reasoning_gym and answer_format
rewards (operators/common/task_answers.py), and the config problems they report before anything starts."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from operators.stages.reward import REWARD_FUNCTIONS
from operators.common.task_answers import (
    ANSWER_FORMAT, ANSWER_FORMATS, SYSTEM_PROMPT, entry_from_json, entry_to_json, extract_answer,
)
from pipelines.data import reasoning_tasks
from pipelines.config.base import ConfigError
from pipelines.config.data import DataConfig
from pipelines.config.load import load_config
from pipelines.data.datasets import load_prompts
from pipelines.data.reasoning_tasks import TaskError, make_task_dataset

pytest.importorskip("reasoning_gym")

ONE_DIGIT_SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
                  "allow_parentheses": False, "allow_negation": False}


def questions(frame: pd.DataFrame) -> list[str]:
    return [messages[0]["content"] for messages in frame["prompt"]]


def config_for(tmp_path: Path, data: dict, **sections):
    file = tmp_path / "job.yaml"
    file.write_text(yaml.safe_dump({"data": data, **sections}))
    return load_config(file)


def problems_of(tmp_path: Path, data: dict, **sections) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        config_for(tmp_path, data, **sections)
    return dict(info.value.problems)


# --- the table and its splits -----------------------------------------------------------------


def test_splits_never_overlap_at_realistic_sizes_and_are_stable():
    train = load_prompts(DataConfig(path="reasoning_gym:leg_counting", num_prompts=2000, seed=0))[0]
    heldout = load_prompts(DataConfig(path="reasoning_gym:leg_counting", num_prompts=200, seed=0, split="heldout"))[0]
    other_seeds = [make_task_dataset("leg_counting", 200, seed=seed, split="heldout") for seed in (7, 123_456)]
    assert len(train) == 2000 and len(heldout) == 200
    for frame in (train, heldout, *other_seeds):
        assert frame["prompt_id"].is_unique and len(set(questions(frame))) == len(frame)
    for frame in (heldout, *other_seeds):
        assert not set(questions(train)) & set(questions(frame))
        assert not set(train["prompt_id"]) & set(frame["prompt_id"])
    # Another train seed draws other problems, still none held out.
    train_7 = make_task_dataset("leg_counting", 500, seed=7_000, split="train")
    assert not set(questions(train_7)) & set(questions(heldout))
    # Stable: the same call gives the same table.
    again = load_prompts(DataConfig(path="reasoning_gym:leg_counting", num_prompts=200, seed=0, split="heldout"))[0]
    pd.testing.assert_frame_equal(heldout, again)
    both = make_task_dataset("leg_counting", 300, seed=0, split="all")
    assert {reasoning_tasks.split_of(reasoning_tasks.problem_hash("leg_counting", q)) for q in questions(both)} == {
        "train", "heldout"}


def test_table_columns_and_stable_ids():
    frame = make_task_dataset("leg_counting", 30, seed=3)
    assert list(frame.columns) == ["prompt", "prompt_id", "answer", "rg_task", "rg_entry", "rg_options"]
    row = frame.iloc[0]
    question = row["prompt"][0]["content"]
    assert row["prompt"] == [{"role": "user", "content": question}]
    assert row["prompt_id"] == "leg_counting-" + hashlib.sha256(f"leg_counting\n{question}".encode()).hexdigest()[:16]
    entry = entry_from_json(row["rg_entry"])
    assert entry["question"] == question and entry["answer"] == row["answer"] and row["rg_task"] == "leg_counting"
    # The same problem drawn under another seed keeps its id (reasoning-gym seeds entry i with seed + i).
    shifted = make_task_dataset("leg_counting", 30, seed=4)
    common = set(frame["prompt_id"]) & set(shifted["prompt_id"])
    assert len(common) >= 25
    by_id = dict(zip(shifted["prompt_id"], questions(shifted)))
    assert all(by_id[pid] == q for pid, q in zip(frame["prompt_id"], questions(frame)) if pid in common)


def test_task_options_reach_the_task():
    one_animal = make_task_dataset("leg_counting", 40, task_options={"min_animals": 1, "max_animals": 1})
    metadata = [entry_from_json(text)["metadata"] for text in one_animal["rg_entry"]]
    assert {m["num_animals"] for m in metadata} == {1}
    assert json.loads(one_animal["rg_options"].iloc[0]) == {"max_animals": 1, "min_animals": 1}
    sums = make_task_dataset("basic_arithmetic", 40, task_options=ONE_DIGIT_SUMS)
    assert all(q.startswith("Calculate ") and " + " in q and "-" not in q and "*" not in q for q in questions(sums))
    assert all(int(a) <= 20 for a in sums["answer"])  # "1 digit" here is 0..10


def test_a_task_with_too_few_problems_is_an_error_that_says_how_many():
    with pytest.raises(ConfigError) as info:
        load_prompts(DataConfig(path="reasoning_gym:basic_arithmetic", num_prompts=500, split="heldout",
                                task_options=ONE_DIGIT_SUMS))
    (field, message), = info.value.problems
    assert field == "data.num_prompts"
    assert "gave only" in message and "distinct heldout problems" in message and "lower num_prompts" in message


def test_entries_survive_json_with_tuples_and_sets():
    entry = {"question": "q", "answer": "a", "metadata": {"grid": ((1, 2), (3, 4)), "seen": {3, 1}, "n": [1, (2,)]}}
    assert entry_from_json(entry_to_json(entry)) == entry


# --- the rewards ------------------------------------------------------------------------------


def sum_problem(question: str = "Calculate 3 + 4.") -> dict[str, list]:
    sums = make_task_dataset("basic_arithmetic", 121, task_options=ONE_DIGIT_SUMS, split="all")
    row = sums[[q == question for q in questions(sums)]].iloc[0]
    assert row["answer"] == "7"
    return {"rg_task": [row["rg_task"]], "rg_entry": [row["rg_entry"]], "rg_options": [row["rg_options"]],
            "answer": [row["answer"]], "prompt_id": [row["prompt_id"]]}


# (completion, reasoning_gym score, answer_format score). The declared format is a sentence 'The answer is N.';
# when a completion states several answers, the last one counts.
CASES = [
    ("3 + 4 = 7. The answer is 7.", 1.0, 1.0),  # correct
    ("So, the answer is **7**", 1.0, 1.0),  # markdown around it is ignored
    ("3 + 4 = 8. The answer is 8.", 0.0, 1.0),  # wrong, but in the format
    ("3 + 4 = 7", 0.0, 0.0),  # right number, no stated answer
    ("<answer>7</answer>", 0.0, 0.0),  # another format
    ("The answer is 8. Wait: the answer is 7.", 1.0, 1.0),  # several: the last counts
    ("The answer is 7. No, the answer is 8.", 0.0, 1.0),
    ("The answer is", 0.0, 0.0),  # empty
    ("", 0.0, 0.0),
]


def test_reasoning_gym_reward_scores_hand_made_completions():
    assert ANSWER_FORMAT == "sentence" and SYSTEM_PROMPT == ANSWER_FORMATS["sentence"].system_prompt
    columns = sum_problem()
    completions = [text for text, _, _ in CASES]
    wide = {key: value * len(CASES) for key, value in columns.items()}
    reward = REWARD_FUNCTIONS.get("reasoning_gym")
    assert reward(completions, **wide) == [score for _, score, _ in CASES]
    assert REWARD_FUNCTIONS.get("answer_format")(completions, **wide) == [fmt for _, _, fmt in CASES]
    # Without rg_options (a table made elsewhere) the task's default options score.
    del wide["rg_options"]
    assert reward(completions, **wide) == [score for _, score, _ in CASES]


def test_the_task_scorer_decides_partial_credit():
    """leg_counting scores with reasoning-gym's default: an answer holding the right number among other text
    gets part of the credit (len(answer) / len(stated))."""
    frame = make_task_dataset("leg_counting", 1)
    answer = frame["answer"].iloc[0]
    columns = {"rg_task": list(frame["rg_task"]) * 2, "rg_entry": list(frame["rg_entry"]) * 2}
    scores = REWARD_FUNCTIONS.get("reasoning_gym")(
        [f"The answer is {answer}.", f"The answer is {answer} legs."], **columns)
    assert scores[0] == 1.0 and 0 < scores[1] < 1


def test_other_formats_extract_the_last_complete_answer():
    assert extract_answer("<answer>3</answer> then <answer> 5 </answer>", "tag") == "5"
    assert extract_answer("<answer>3</answer> then <answer>5", "tag") == "3"  # unclosed tag: not an answer
    assert extract_answer("<answer></answer>", "tag") is None
    assert extract_answer("Answer: 4\nwork\n**Answer:** 9", "line") == "9"
    assert extract_answer("The Answer: 4", "line") is None  # must start its line
    assert extract_answer("The answer is 3.5. Then more.", "sentence") == "3.5"


# --- config problems, reported before anything starts ------------------------------------------


def test_unknown_task_lists_every_task(tmp_path):
    problems = problems_of(tmp_path, {"path": "reasoning_gym:leg_count"})
    message = problems["data.path"]
    assert "unknown reasoning_gym task 'leg_count'" in message
    import reasoning_gym

    assert all(name in message for name in reasoning_gym.factory.DATASETS)


def test_options_the_task_does_not_take_are_named(tmp_path):
    problems = problems_of(tmp_path, {"path": "reasoning_gym:leg_counting",
                                      "task_options": {"max_legs": 4, "min_animals": 1}})
    message = problems["data.task_options"]
    assert "['max_legs']" in message and "min_animals" in message and "max_instances" in message
    refused = problems_of(tmp_path, {"path": "reasoning_gym:leg_counting",
                                     "task_options": {"min_animals": 5, "max_animals": 2}})
    assert "refuses the options" in refused["data.task_options"]


def test_split_and_task_options_apply_only_to_reasoning_gym(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    problems = problems_of(tmp_path, {"path": str(data), "split": "heldout", "task_options": {"a": 1}})
    assert "applies only to reasoning_gym" in problems["data.split"]
    assert "applies only to reasoning_gym" in problems["data.task_options"]
    config_for(tmp_path, {"path": str(data)}, eval={"data": {"path": str(data)}})  # defaults are no problem


def test_missing_package_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(reasoning_tasks, "reasoning_gym_module", lambda: None)
    problems = problems_of(tmp_path, {"path": "reasoning_gym:leg_counting"},
                           eval={"data": {"path": "reasoning_gym:leg_counting"}})
    for field in ("data.path", "eval.data.path"):
        assert "pip install reasoning-gym==0.1.25" in problems[field]
    with pytest.raises(ConfigError, match="pip install reasoning-gym==0.1.25"):
        load_prompts(DataConfig(path="reasoning_gym:leg_counting"))


def test_a_valid_config_loads(tmp_path):
    cfg = config_for(tmp_path, {"path": "reasoning_gym:leg_counting", "task_options": {"max_animals": 3},
                                "system_prompt": SYSTEM_PROMPT},
                     eval={"data": {"path": "reasoning_gym:leg_counting", "num_prompts": 20}},
                     reward={"functions": [{"name": "reasoning_gym"}, {"name": "answer_format", "weight": 0.1}]})
    assert cfg.eval.data.split == "heldout" and cfg.data.split == "train"


def test_cli_validate_exits_2_for_an_unknown_task(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"data": {"path": "reasoning_gym:no_such_task"},
                                      "output_dir": str(tmp_path / "runs")}))
    out = subprocess.run([sys.executable, "-m", "pipelines.cli", "validate", str(config)],
                         check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "unknown reasoning_gym task 'no_such_task'" in out.stderr and "leg_counting" in out.stderr
    assert "Traceback" not in out.stderr
