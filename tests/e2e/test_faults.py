"""Faults, for real: processes killed with SIGKILL in the middle of a job.

* the driver (`streamrl run` in its own process) at a random step, then `--resume latest`;
* a generate actor and a reward actor (Ray Data restarts them and retries their tasks) and a
  trainer rank (the job restarts the trainer group from the last checkpoint, bounded by
  train.max_restarts; past that it fails with the run to resume, and the resume finishes it);
* a reward function that hangs and a loss that overflows, mid-job.

Every time the final checkpoint's ledger must hold each prompt of the epoch exactly once,
each step its groups, and the staleness bound; at max_staleness 0 the resumed run's final
weights must equal an uninterrupted run's (the critic's too, for PPO with a critic).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
from safetensors.numpy import load_file

from pipelines.recovery.checkpoint import CheckpointDir
from pipelines.config.load import load_config
from pipelines.job import JobFailed, run_job

ROOT = Path(__file__).resolve().parents[2]
# One epoch: every prompt is scheduled exactly once. 16 steps, so that a kill reported at step 5 lands
# while training goes on: the loop is fast enough that 3 steps left could all finish before it did.
STEPS, GROUPS, N, PROMPTS = 16, 4, 4, 64
pytestmark = pytest.mark.slow


def overrides(output_dir: Path, **extra) -> list[str]:
    values = {
        "train.steps": STEPS, "train.groups_per_step": GROUPS, "rollout.n": N, "rollout.groups_per_call": 2,
        "data.num_prompts": PROMPTS, "train.checkpoint_every": 2, "train.checkpoint_keep": 0,
        "rollout.num_cpus": 0.25, "output_dir": str(output_dir), **extra,
    }
    return [f"{key}={value}" for key, value in values.items()]


def config(output_dir: Path, config_file: str = "tiny_grpo.yaml", **extra):
    return load_config(ROOT / "configs" / config_file, overrides(output_dir, **extra))


def final_ledger(output_dir: Path, run_id: str, steps: int = STEPS) -> pd.DataFrame:
    checkpoint = CheckpointDir.of_run(output_dir, run_id).latest_valid()
    assert checkpoint is not None and checkpoint.step == steps, checkpoint
    return checkpoint.ledger()


def assert_exactly_once(ledger: pd.DataFrame, max_staleness: int, steps: int = STEPS, groups: int = GROUPS) -> None:
    """One epoch of steps x groups prompts: each trained once, in its step, within the staleness bound."""
    prompts = steps * groups
    expected = {f"arith-{index:05d}" for index in range(prompts)}
    assert len(ledger) == prompts, ledger
    assert ledger["group_uid"].is_unique and ledger["prompt_id"].is_unique
    assert set(ledger["prompt_id"]) == expected
    assert ledger.groupby("train_step").size().to_dict() == {step: groups for step in range(steps)}
    assert ledger["trained"].all()
    assert (ledger["staleness"] == ledger["train_step"] - ledger["policy_version"]).all()
    assert ledger["staleness"].between(0, max_staleness).all(), ledger["staleness"].value_counts()


def actor_pids(class_part: str) -> list[int]:
    """Pids of this cluster's live actors whose class name contains `class_part` (from the GCS;
    the state API would need the dashboard, which test clusters do not start)."""
    from ray._private import state

    return [a["Pid"] for a in state.actors().values()
            if a["State"] == "ALIVE" and class_part in a["ActorClassName"] and a.get("Pid")]


class KillAt:
    """An `echo` for run_job: passes lines through and runs `action` when step `k` is reported."""

    def __init__(self, actions: dict[int, callable]):
        self.actions = dict(actions)
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        print(line, flush=True)
        match = re.match(r"step\s+(\d+)/", line)
        if match and int(match.group(1)) in self.actions:
            self.actions.pop(int(match.group(1)))()


def signal_driver_at_step(argv: list[str], env: dict, step: int, signum: int) -> tuple[int, str]:
    """`streamrl run` in its own process, as a user runs it, sent `signum` once it reports `step`: its exit
    code and everything it printed. Whatever is left of its local Ray cluster is killed afterwards."""
    driver = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, start_new_session=True)
    seen = []
    try:
        for line in driver.stdout:  # read to the end: the driver's last words (a resume command) included
            seen.append(line)
            if re.match(rf"step\s+{step}/", line):
                driver.send_signal(signum)
        return driver.wait(timeout=120), "".join(seen)
    finally:
        if driver.poll() is None:
            driver.kill()
        time.sleep(5)  # Ray's reaper takes the dead driver's local cluster down; clear what is left
        try:
            os.killpg(driver.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def sigkill(pids: list[int]) -> None:
    assert pids, "nothing to kill"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


# The PPO variant (critic restored from the checkpoint too) takes as long again and is left out of CI
# (make test-extended); tests/integration/test_critic.py checks the critic's checkpoint round trip in seconds.
@pytest.mark.parametrize("config_file", ["tiny_grpo.yaml", pytest.param("tiny_ppo.yaml", marks=pytest.mark.extended)])
def test_driver_sigkill_at_random_step_then_resume_matches_uninterrupted(ray_cluster, tmp_path, config_file):
    # The reference: the same job, uninterrupted, in this process.
    reference = run_job(config(tmp_path / "reference", config_file, **{"train.max_staleness": 0}))
    # The same job as a user runs it, its driver killed with SIGKILL at a random step.
    seed = int(os.environ.get("STREAMRL_FAULT_SEED", time.time()))
    kill_after = random.Random(seed).randint(3, STEPS - 1)
    print(f"fault seed {seed}: SIGKILL the driver once it reports step {kill_after}/{STEPS}")
    out = tmp_path / "killed"
    argv = [sys.executable, "-m", "pipelines.cli", "run", f"configs/{config_file}",
            *[arg for item in overrides(out, **{"train.max_staleness": 0}) for arg in ("--set", item)]]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    code, text = signal_driver_at_step(argv, env, kill_after, signal.SIGKILL)
    assert code == -signal.SIGKILL, text
    run_id = re.search(r"MLflow run (\w+)", text).group(1)
    resumed = subprocess.run(argv + ["--resume", "latest"], cwd=ROOT, capture_output=True, text=True, env=env,
                             timeout=600, start_new_session=True)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    match = re.search(rf"resuming run {run_id} from checkpoint \S+ \(step (\d+)\)", resumed.stdout)
    assert match, resumed.stdout[-3000:]
    resumed_from = int(match.group(1))
    assert 2 <= resumed_from <= kill_after + 1 and resumed_from % 2 == 0, resumed_from
    # The resumed job reported only the steps after its checkpoint, in the same MLflow run.
    reported = [int(s) for s in re.findall(r"^step\s+(\d+)/", resumed.stdout, re.MULTILINE)]
    assert reported == list(range(resumed_from + 1, STEPS + 1)), reported
    mlflow.set_tracking_uri(f"sqlite:///{out.resolve() / 'mlflow.db'}")
    run = mlflow.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["resume.count"] == "1"
    # Each step once in the metric history (the killed driver's steps after its checkpoint were never
    # logged), with the attempt that trained it.
    history = mlflow.tracking.MlflowClient().get_metric_history(run_id, "reward_mean")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    attempts = {m.step: m.value for m in mlflow.tracking.MlflowClient().get_metric_history(run_id, "attempt")}
    assert attempts == {step: 1.0 if step <= resumed_from else 2.0 for step in range(1, STEPS + 1)}, attempts
    assert run.data.tags["attempts"] == "2"
    assert_exactly_once(final_ledger(out, run_id), max_staleness=0)
    # Same seed, staleness 0: the interrupted-and-resumed policy is the uninterrupted one.
    expected = load_file(str(reference.checkpoint / "model.safetensors"))
    got = load_file(str(CheckpointDir.of_run(out, run_id).latest_valid().path / "model.safetensors"))
    assert expected.keys() == got.keys()
    start = load_file(str(Path(reference.model_path) / "model.safetensors"))
    assert any(not np.array_equal(start[name], expected[name]) for name in expected)  # it did learn something
    # Within float tolerance: the two runs are separate processes; a 1e-5 bound is far below one
    # update (lr 1e-3 per element) and would catch any step trained twice, skipped or reordered.
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-5, err_msg=name)
    if config_file == "tiny_ppo.yaml":  # the critic was restored from the checkpoint, not trained afresh
        critic = Path("critic") / "model" / "model.safetensors"
        expected = load_file(str(reference.checkpoint / critic))
        got = load_file(str(CheckpointDir.of_run(out, run_id).latest_valid().path / critic))
        assert expected.keys() == got.keys() and "score.weight" in expected
        assert any(not np.array_equal(start[name], expected[name]) for name in start if name in expected)
        for name in expected:
            np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-5, err_msg=f"critic {name}")
        history = mlflow.tracking.MlflowClient().get_metric_history(run_id, "critic_version")
        # staleness 0: every group of step s was valued by critic version s, in both attempts
        assert sorted((m.step, m.value) for m in history) == [(step + 1, float(step)) for step in range(STEPS)]


# make test-extended (141 s): CI keeps a generate actor SIGKILLed mid-job with a restart and exactly-once ledger
# (test_in_flight.py, mid weight transfer) and a lost trainer rank's restart (test_node_loss.py)
@pytest.mark.extended
def test_actors_sigkilled_midjob_restart_then_resume(ray_cluster, tmp_path):
    """One job, four SIGKILLs: a generate actor (step 2), a trainer rank (step 3: the job restarts
    from the last checkpoint), a reward actor (the restarted DAG's first step), the rank again (its
    second: restarts exhausted, the job fails naming the run); then the resume finishes it."""
    killed: dict[str, list[int]] = {}

    def kill(kind: str, class_part: str) -> None:
        pids = actor_pids(class_part)
        if not pids:  # say what there was instead
            from ray._private import state

            print("no live actor of", class_part, [(a["State"], a["ActorClassName"]) for a in state.actors().values()])
        killed.setdefault(kind, []).extend(pids)
        sigkill(pids)

    # The later kills count the steps reported after the restart, not step numbers: the loop is fast
    # enough that the trainer may report a few more steps before the first rank's death surfaces.
    after_restart: list[int] = []

    def on_step(line: str) -> None:
        if "restarting the trainer group" in line:
            after_restart.append(-1)  # marks the restart
        match = re.match(r"step\s+(\d+)/", line)
        if not match:
            return
        step = int(match.group(1))
        if not after_restart:
            if step == 2 and "generate" not in killed:
                kill("generate", "Generate")
            elif step == 3 and "rank" not in killed:
                kill("rank", "TrainWorker")
            return
        after_restart.append(step)
        if len(after_restart) == 2:
            kill("reward", "Reward")
        elif len(after_restart) == 3:
            kill("rank", "TrainWorker")

    echo = KillAt({})  # prints and keeps the lines; the kills are on_step's

    def log_and_kill(line: str) -> None:
        echo(line)
        on_step(line)

    # reward.placement stage: reward actors of their own, to kill (tiny_grpo.yaml scores in the generate actors).
    # A reward a quarter of a second slow paces the job: unpaced, the tiny loop trains several steps between
    # the driver's report of a step and the kill it triggers, so a restarted attempt could finish generating
    # (its reward actors gone) before the next kill, or a rank die after a checkpoint whose step's row it
    # had not delivered yet. (tests/ is importable as a namespace package from the repository root, which is
    # the working directory of the test cluster's workers.)
    cfg = config(tmp_path, **{"train.max_staleness": 1, "train.max_restarts": 1, "reward.placement": "stage",
                              "reward.functions": "[{name: 'tests.reward_fixtures:slow_exact'}]"})
    with pytest.raises(JobFailed) as failure:
        run_job(cfg, echo=log_and_kill)
    assert len(killed["generate"]) == 1 and len(killed["reward"]) == 1 and len(killed["rank"]) == 2, killed
    reported = [int(m.group(1)) for line in echo.lines if (m := re.match(r"step\s+(\d+)/", line))]
    # Generate and reward actors were restarted by Ray Data: the same attempt went on (the second rank
    # kill came a step after the reward kill, in the same attempt).
    assert reported[reported.index(2) + 1] == 3, reported
    # The rank's first death: restarted automatically from the last checkpoint (one at or after step 2).
    restarts = [line for line in echo.lines if "restarting the trainer group" in line]
    assert len(restarts) == 1, echo.lines[-20:]
    restarted_from = int(re.search(r"from step (\d+) \(restart 1/1, attempt 2;", restarts[0]).group(1))
    assert restarted_from % 2 == 0 and restarted_from >= 2, restarts[0]
    # The message says what died: the rank itself, or the object it owned (the published weights).
    assert re.search(r"\((ActorDiedError \(TrainWorker|OwnerDiedError)", restarts[0]), restarts[0]
    # Its second death: restarts exhausted; the failure names the run and the step to resume from.
    run_id, step = failure.value.run_id, failure.value.resume_step
    # a checkpoint (every 2 steps) after the restart's, before the end: how far the fast loop got
    # before the kill took effect varies
    assert step % 2 == 0 and restarted_from < step < STEPS, step
    resumed = run_job(cfg, resume=run_id, echo=print)
    assert resumed.run_id == run_id
    assert resumed.metrics["step"].tolist() == list(range(step + 1, STEPS + 1))
    assert_exactly_once(final_ledger(tmp_path, run_id), max_staleness=1)
    mlflow.set_tracking_uri(cfg.tracking_uri())
    run = mlflow.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["restarts"] == "1"
    # Steps retrained after the restart and after the resume are logged once, with the attempt that
    # trained them: the first (before the restart), the restarted one, the resume.
    client = mlflow.tracking.MlflowClient()
    for metric in ("reward_mean", "policy_loss", "staleness_max"):
        assert sorted(m.step for m in client.get_metric_history(run_id, metric)) == list(range(1, STEPS + 1)), metric
    attempts = {m.step: m.value for m in client.get_metric_history(run_id, "attempt")}
    assert attempts == {s: 1.0 if s <= restarted_from else 2.0 if s <= step else 3.0 for s in range(1, STEPS + 1)}, attempts
    assert run.data.tags["attempts"] == "3"


def test_hanging_reward_and_nonfinite_loss_midjob(tmp_path):
    """End to end, as a user runs it (their reward module on PYTHONPATH): a reward call that never
    returns costs its batch (timeout from config), a step whose loss is inf is skipped, and the job
    finishes with finite weights and a ledger that says which step was skipped."""
    out = tmp_path / "job"
    sets = overrides(out, **{"train.max_staleness": 1, "reward.timeout_s": 3, "algorithm.advantage": "grpo_no_std",
                             "reward.functions": "[{name: 'reward_fixtures:troublemaker'}]"})
    argv = [sys.executable, "-m", "pipelines.cli", "run", "configs/tiny_grpo.yaml",
            *[arg for item in sets for arg in ("--set", item)]]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600,
                          start_new_session=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_id = re.search(r"MLflow run (\w+)", done.stdout).group(1)
    ledger = final_ledger(out, run_id)
    exploded = int(ledger.loc[ledger["prompt_id"] == "arith-00007", "train_step"].iloc[0])
    hung = int(ledger.loc[ledger["prompt_id"] == "arith-00003", "train_step"].iloc[0])
    # Every prompt still went through exactly once; only the exploding step is marked untrained.
    assert len(ledger) == PROMPTS and ledger["prompt_id"].is_unique
    assert set(ledger.loc[~ledger["trained"], "train_step"]) == {exploded}
    assert f"step {exploded + 1}: the loss was not finite; step skipped" in done.stdout
    mlflow.set_tracking_uri(f"sqlite:///{out.resolve() / 'mlflow.db'}")
    client = mlflow.tracking.MlflowClient()
    skipped = {m.step: m.value for m in client.get_metric_history(run_id, "nonfinite_skipped")}
    assert skipped == {step: float(step == exploded + 1) for step in range(1, STEPS + 1)}  # MLflow counts steps from 1
    timeouts = {m.step: m.value for m in client.get_metric_history(run_id, "reward_timeouts")}
    assert timeouts[hung + 1] >= N and all(v == 0 for step, v in timeouts.items() if step != hung + 1), timeouts
    weights = load_file(str(CheckpointDir.of_run(out, run_id).latest_valid().path / "model.safetensors"))
    assert all(np.isfinite(array).all() for array in weights.values())


# make test-extended (~2 min): CI stays under 45 minutes; tests/integration/test_preemption.py checks the stop's mechanics in
# seconds, and benchmarks/chaos.py sends SIGTERM to a job and resumes it
@pytest.mark.extended
def test_sigterm_finishes_the_step_checkpoints_and_the_resume_finishes(ray_cluster, tmp_path):
    """A preemption as Kubernetes or `ray job stop` sends it: SIGTERM to the driver mid-job. The step in
    progress finishes and is checkpointed off the checkpoint_every schedule, the MLflow run is ended
    KILLED (stopped_by: preemption), the resume command is printed and the exit code is 75; the resume
    trains the rest, every step is logged once in MLflow, and the ledger holds every group exactly once."""
    from pipelines.recovery.preemption import PREEMPTED_EXIT

    out = tmp_path / "preempted"
    argv = [sys.executable, "-m", "pipelines.cli", "run", "configs/tiny_grpo.yaml",
            *[arg for item in overrides(out, **{"train.checkpoint_every": 5}) for arg in ("--set", item)]]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    code, text = signal_driver_at_step(argv, env, 3, signal.SIGTERM)
    assert code == PREEMPTED_EXIT, text[-3000:]
    run_id = re.search(r"MLflow run (\w+)", text).group(1)
    match = re.search(r"stopped on SIGTERM after step (\d+), which was trained and checkpointed", text)
    assert match and "resume with:" in text and "--resume" in text, text[-3000:]
    stopped_at = int(match.group(1))
    assert 3 <= stopped_at < STEPS
    checkpoint = CheckpointDir.of_run(out, run_id).latest_valid()
    assert checkpoint.step == stopped_at  # written at the stop, whatever checkpoint_every (5) says
    reported = [int(s) for s in re.findall(r"^step\s+(\d+)/", text, re.MULTILINE)]
    assert reported[-1] == stopped_at  # nothing was trained after the checkpoint
    mlflow.set_tracking_uri(f"sqlite:///{out.resolve() / 'mlflow.db'}")
    run = mlflow.get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["stopped_by"] == "preemption"
    resumed = subprocess.run(argv + ["--resume", "latest"], cwd=ROOT, capture_output=True, text=True, env=env,
                             timeout=600, start_new_session=True)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"from checkpoint {checkpoint.path} (step {stopped_at})" in resumed.stdout
    history = mlflow.tracking.MlflowClient().get_metric_history(run_id, "reward_mean")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))  # each step once: none trained twice
    assert_exactly_once(final_ledger(out, run_id), max_staleness=1)
