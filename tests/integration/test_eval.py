"""Held-out evaluation: the metrics (hand-computed), the tiny task's splits, greedy decoding, the
policy store's retained versions, and `streamrl eval`'s refusals of bad input before anything
starts. The end-to-end figures (held-out success rising, `streamrl eval` reproducing the
in-training figure) are checked on the README's job in tests/e2e/test_learning.py."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from operators.algorithms.eval_metrics import pass_at_k, pass_at_ks, summarize, summarize_greedy, summarize_sampled
from operators.stages.train import LEDGER_COLUMNS
from pipelines.recovery.checkpoint import CheckpointDir, dataset_digest
from pipelines.cli import main
from pipelines.config.base import ConfigError
from pipelines.config.load import load_config
from pipelines.recovery.resume import run_file_info
from pipelines.data.tiny import make_arithmetic_dataset, split_problems

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_grpo.yaml"


# --- metrics -------------------------------------------------------------------------------


def test_pass_at_k_matches_hand_computed_values():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # one of four samples right: k=1 draws it 1/4 of the time
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(4, 3, 2) == 1.0  # only one wrong sample: any two include a right one
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 8, 1) == 1.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    assert pass_at_ks(8) == [1, 2, 4, 8] and pass_at_ks(6) == [1, 2, 4, 6] and pass_at_ks(1) == [1]


def test_summaries_of_scored_rows():
    sampled = pd.DataFrame({
        "prompt_id": ["a", "b"], "mode": "sampled", "policy_version": [3, 3],
        "rewards": [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.5]], "response_lengths": [[1, 2, 3, 2], [2, 2, 2, 2]],
    })
    greedy = pd.DataFrame({
        "prompt_id": ["a", "b"], "mode": "greedy", "policy_version": [3, 3],
        "rewards": [[0.0], [1.0]], "response_lengths": [[2], [4]],
    })
    metrics = summarize_sampled(sampled)
    assert metrics["eval/reward_mean"] == pytest.approx(3.5 / 8)
    assert metrics["eval/success_rate"] == pytest.approx(3 / 8)  # 0.5 is below the success threshold 1.0
    assert metrics["eval/pass_at_1"] == pytest.approx((0.25 + 0.5) / 2)
    assert metrics["eval/pass_at_2"] == pytest.approx((0.5 + (1 - 1 / 6)) / 2)  # b: 1 - C(2,2)/C(4,2)
    assert metrics["eval/pass_at_4"] == 1.0 and metrics["eval/response_length_mean"] == pytest.approx(2.0)
    assert summarize_greedy(greedy) == {"eval/greedy_reward_mean": 0.5, "eval/greedy_success_rate": 0.5,
                                        "eval/greedy_response_length_mean": 3.0}
    both = summarize(pd.concat([sampled, greedy]))
    assert both["eval/num_prompts"] == 2 and both["eval/policy_version"] == 3
    assert both["eval/pass_at_2"] == metrics["eval/pass_at_2"] and both["eval/greedy_success_rate"] == 0.5
    with pytest.raises(ValueError, match="same number of samples"):
        summarize_sampled(sampled.assign(rewards=[[1.0], [1.0, 0.0]]))


# --- the tiny task's splits ------------------------------------------------------------------


def test_heldout_split_is_disjoint_from_training_and_fixed():
    every, train, held = (set(split_problems(9, split)) for split in ("all", "train", "heldout"))
    assert len(held) == 20 and len(train) == 80 and train | held == every and not train & held
    training = make_arithmetic_dataset(256, seed=3, split="train")
    assert not set(training["prompt"]) & {prompt for prompt, _ in held}  # RL never sees a held-out problem
    assert training["prompt_id"].iloc[5] == "arith-00005"
    heldout = make_arithmetic_dataset(256, seed=3, split="heldout")
    assert len(heldout) == 20 and heldout["prompt"].is_unique and heldout["prompt_id"].iloc[0] == "arith-heldout-00000"
    # The split does not move with the data seed; the old builtin (every problem) is unchanged.
    assert set(make_arithmetic_dataset(20, seed=9, split="heldout")["prompt"]) == set(heldout["prompt"])
    assert make_arithmetic_dataset(50, seed=1).equals(make_arithmetic_dataset(50, seed=1, split="all"))


# --- config --------------------------------------------------------------------------------


def problems_of(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    return dict(err.value.problems)


def test_eval_config_is_validated_up_front(tmp_path):
    cfg = load_config(TINY)
    assert cfg.data.path == "builtin:arithmetic-train" and cfg.eval.data.path == "builtin:arithmetic-heldout"
    assert cfg.eval.versions(60) == [0, 10, 20, 30, 40, 50, 60]
    assert load_config(TINY, ["eval.every=0", "eval.at_start=false"]).eval.versions(60) == [60]
    assert load_config(TINY, ["eval.every=25"]).eval.versions(60) == [0, 25, 50, 60]
    assert load_config(TINY, ["eval=null"]).eval is None
    assert "greedy: true" in problems_of(["eval.n=0", "eval.greedy=false"])["eval.n"]
    assert "unknown builtin dataset" in problems_of(["eval.data.path=builtin:nope"])["eval.data.path"]
    no_prompt = tmp_path / "questions.jsonl"
    no_prompt.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    message = problems_of([f"eval.data.path={no_prompt}"])["eval.data.prompt_column"]
    assert "'prompt' is not in" in message and "['question', 'answer']" in message
    with pytest.raises(ConfigError) as err:  # a config without an eval section, given one field of it
        load_config(None, ["eval.every=5"])
    assert "required" in dict(err.value.problems)["eval.data"]


def test_validate_cli_refuses_an_eval_dataset_without_its_prompt_column(tmp_path, capsys):
    data = tmp_path / "held.csv"
    pd.DataFrame({"text": ["1+1="], "answer": ["2"]}).to_csv(data, index=False)
    assert main(["validate", str(TINY), "--set", f"eval.data.path={data}"]) == 2
    assert "eval.data.prompt_column: column 'prompt' is not in" in capsys.readouterr().err


# --- greedy decoding and retained versions ------------------------------------------------------


def test_hf_engine_decodes_greedily_at_temperature_zero(tiny_model_path):
    import torch

    from operators.engines.base import SamplingParams
    from operators.engines.hf import HFEngine

    engine = HFEngine(tiny_model_path)
    prompts = engine.encode(["3+4=", "9+9="])
    runs = [engine.generate(prompts, SamplingParams(n=1, max_new_tokens=3, temperature=0.0, seed=seed))
            for seed in (0, 1)]
    assert [g.token_ids for g in runs[0]] == [g.token_ids for g in runs[1]]  # no sampling: seeds do not matter
    first = torch.tensor([prompts[0]])
    with torch.no_grad():
        logits = engine.model(input_ids=first).logits[0, -1]
    assert runs[0][0].token_ids[0][0] == int(logits.argmax())  # the first token is the argmax
    expected = float(torch.log_softmax(logits, -1).max())  # log-probs of the untempered distribution
    assert runs[0][0].logprobs[0][0] == pytest.approx(expected, abs=1e-5)


def test_policy_store_keeps_retained_versions_until_released(ray_cluster):
    from pipelines.runtime.policy_store import create_policy_store

    store = create_policy_store("retain-test", retain=(1, 3))
    try:
        refs = {v: ray_cluster.put({"w": np.full(2, float(v))}) for v in (1, 2, 3, 4)}
        for version, ref in refs.items():
            store.publish(version, ref)
        one = store.weights_of(1)
        assert ray_cluster.get(one)["w"][0] == 1.0  # replaced three times, still there
        four = store.weights_of(4)
        assert ray_cluster.get(four)["w"][0] == 4.0  # the latest needs no retaining
        with pytest.raises(Exception, match="not retained"):
            store.weights_of(2)
        store.release(1, wait=True)
        with pytest.raises(Exception, match="not retained"):
            store.weights_of(1)
        with pytest.raises(Exception):  # a version not published yet is waited for (here: past the timeout)
            store.weights_of(5, 0.2)
    finally:
        store.kill()


def test_the_evaluator_starts_at_the_first_poll_at_a_lower_cpu_priority(ray_cluster, tiny_model_path, tmp_path):
    """Not beside the job's start-up (the first poll comes after the first trained step), and niced
    (eval.nice), so on shared cores the trainer and the generators go first."""
    import os

    from pipelines.evaluation.in_training import InTrainingEval, load_eval_prompts
    from pipelines.runtime.policy_store import create_policy_store
    from pipelines.stages import engine_options
    from pipelines.tracking.tracker import NullTracker

    cfg = load_config(TINY, [f"model.path={tiny_model_path}", "eval.nice=3", "eval.n=0", "eval.max_prompts=4",
                             "eval.every=0", "train.steps=1", "eval.log_samples=false"])
    prompts, _ = load_eval_prompts(cfg, tiny_model_path, lambda _: None)
    store = create_policy_store("lazy-eval-test", retain=(0,))
    rows, lines = [], []

    evaluation = InTrainingEval(cfg, prompts, tiny_model_path, engine_options(cfg), store, [0], NullTracker(),
                                lines.append, rows, tmp_path)
    try:
        assert evaluation.actor is None  # made, not started
        evaluation.finish()  # starts it, evaluates version 0 (the model itself: no weights to wait for)
        assert [row["step"] for row in rows] == [0] and lines[-1].startswith("streamrl: eval at step 0")
        evaluator = ray_cluster.get(evaluation.actor.__ray_call__.remote(lambda actor: os.nice(0)))
        worker = ray_cluster.get(ray_cluster.remote(lambda: os.nice(0)).remote())  # Ray's worker_niceness
        assert evaluator == min(worker + 3, 19)
    finally:
        evaluation.close()
        store.kill()


# --- `streamrl eval`: bad input, refused before anything starts --------------------------------


def fake_run(tmp_path: Path, tiny_model_path: str, overrides: list[str] = (), steps: tuple[int, ...] = (2,)) -> str:
    """A run folder as a job leaves it: run.json, and checkpoints whose Hugging Face export is the
    base model (no engine state: `streamrl eval` reads only the export)."""
    output_dir = tmp_path / "out"
    cfg = load_config(TINY, [f"output_dir={output_dir}", *overrides])
    run_id = "run0123"
    store = CheckpointDir.of_run(output_dir, run_id)
    store.write_run_file(run_file_info(cfg, run_id, dataset_digest(make_arithmetic_dataset(8)), time.time()))
    for step in steps:
        tmp = store.begin(step)
        for file in Path(tiny_model_path).iterdir():
            if file.is_file():
                shutil.copy(file, tmp / file.name)
        ledger = pd.DataFrame(columns=LEDGER_COLUMNS)
        store.commit(tmp, step, {"run_id": run_id, "policy_version": step}, ledger)
    return run_id


def refused(capsys, argv: list[str], output_dir: Path) -> str:
    assert main(argv) == 2
    assert not (output_dir / "mlflow.db").exists() and not (output_dir / "eval").exists()  # nothing started
    return capsys.readouterr().err


def test_eval_refuses_what_is_not_a_checkpoint_or_has_none(tmp_path, tiny_model_path, capsys):
    out = tmp_path / "out"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "is not a streamrl checkpoint" in refused(capsys, ["eval", str(empty)], out)
    err = refused(capsys, ["eval", "nosuch", "--output-dir", str(out)], out)
    assert "no run 'nosuch'" in err and "or a checkpoint folder" in err
    run_id = fake_run(tmp_path, tiny_model_path, steps=())
    err = refused(capsys, ["eval", run_id, "--output-dir", str(out)], out)
    assert f"run {run_id} has no complete checkpoint yet" in err
    fake_run(tmp_path, tiny_model_path, steps=(2, 4))
    err = refused(capsys, ["eval", run_id, "--output-dir", str(out), "--step", "3"], out)
    assert "no checkpoint at step 3 (it has steps [2, 4])" in err


def test_eval_refuses_bad_data_and_unknown_rewards(tmp_path, tiny_model_path, capsys):
    run_id = fake_run(tmp_path, tiny_model_path)
    out = tmp_path / "out"
    checkpoint = str(out / "checkpoints" / run_id / "step_000002")
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    err = refused(capsys, ["eval", checkpoint, "--data", str(questions)], out)
    assert "--data (prompt column" in err and "its columns are ['question', 'answer']" in err
    err = refused(capsys, ["eval", checkpoint, "--data", str(tmp_path / "missing.csv")], out)
    assert "--data: dataset file" in err and "does not exist" in err
    err = refused(capsys, ["eval", run_id, "--output-dir", str(out), "--reward", "no_such_reward"], out)
    assert "reward.functions.0.name (--reward)" in err and "unknown reward function 'no_such_reward'" in err
    fake_run(tmp_path / "b", tiny_model_path, ["eval=null"])
    err = refused(capsys, ["eval", run_id, "--output-dir", str(tmp_path / "b" / "out")], tmp_path / "b" / "out")
    assert "--data: the run has no eval.data" in err
