"""A step reaches MLflow once: rows wait for the checkpoint that covers them (pipelines/recovery/step_log.py).
The end-to-end proof, with real restarts and resumes, is in tests/e2e/test_faults.py."""

from __future__ import annotations

import json

from pipelines.recovery.checkpoint import CheckpointDir
from pipelines.recovery.step_log import EvalRows, StepLog, write_dropped


class Recorder:
    def __init__(self):
        self.steps, self.artifacts = [], []

    def log_step(self, row):
        self.steps.append(row["step"])

    def log_artifact(self, path, artifact_path=None):
        self.artifacts.append((str(path), artifact_path))


def test_rows_wait_for_their_checkpoint_and_a_restart_drops_the_rest():
    tracker = Recorder()
    log = StepLog(tracker, committed=0)
    for step in (1, 2, 3):  # steps count from 1 (the Train operator's rows); the checkpoint after step 2 covers 2
        log.hold({"step": step}, step)
    assert tracker.steps == []
    assert log.commit(2) == 2 and tracker.steps == [1, 2]
    evals = EvalRows(log)
    evals.log_step({"step": 2})  # version 2: covered by the checkpoint of 2 steps already
    evals.log_artifact("/x/eval_2.parquet", "eval")
    evals.log_step({"step": 3})  # version 3: not yet
    evals.log_artifact("/x/eval_3.parquet", "eval")
    assert tracker.steps == [1, 2, 2] and tracker.artifacts == [("/x/eval_2.parquet", "eval")]
    log.hold({"step": 4}, 4)
    # A restart from the checkpoint of 2 steps: steps 3 and 4 and version 3 are trained and evaluated again.
    dropped = log.drop(2)
    assert [row["step"] for row in dropped] == [3, 3, 4] and log.held == []
    for step in (3, 4):
        log.hold({"step": step}, step)
    log.commit(4)
    assert tracker.steps == [1, 2, 2, 3, 4]  # step 2's row, then version 2's evaluation (after step 2)
    # A checkpoint the driver never heard of (a rank died after writing it): a restart from it logs what it covers.
    log.hold({"step": 5}, 5)
    assert log.drop(5) == [] and tracker.steps[-1] == 5


def test_dropped_rows_are_kept_as_an_artifact(tmp_path):
    tracker = Recorder()
    assert write_dropped([], tmp_path, 1, tracker) is None and tracker.artifacts == []
    path = write_dropped([{"step": 7, "policy_loss": float("nan"), "rollouts_parquet": b"x", "attempt": 2}],
                         tmp_path, 2, tracker)
    assert tracker.artifacts == [(path, "dropped")] and path.endswith("attempt_2.jsonl")
    assert [json.loads(line) for line in open(path)] == [{"step": 7, "policy_loss": "nan", "attempt": 2}]


def test_attempts_are_counted_in_the_run_file(tmp_path):
    run_dir = CheckpointDir(tmp_path / "run")
    run_dir.root.mkdir(parents=True, exist_ok=True)
    run_dir.write_run_file({"run_id": "r"})
    assert [run_dir.next_attempt() for _ in range(3)] == [1, 2, 3]
    assert run_dir.run_file() == {"run_id": "r", "attempts": 3}


def test_backfill_logs_the_checkpointed_rows_nobody_logged(tmp_path):
    """A driver that died after the Train operator wrote a checkpoint, before it logged that checkpoint's
    steps: the checkpoint keeps their rows, and the next process logs exactly the missing ones."""
    from pipelines.recovery.checkpoint import STEP_ROWS, Checkpoint

    folder = tmp_path / "step_000004"
    folder.mkdir()
    (folder / STEP_ROWS).write_text("".join(json.dumps({"step": s, "reward_mean": s / 10}) + "\n" for s in (2, 3)))
    tracker = Recorder()
    log = StepLog(tracker, committed=4, attempt=2)
    assert log.backfill(Checkpoint(folder, 4, {}), attempt=1, logged_before={0, 1, 2}) == [3]
    assert tracker.steps == [3] and log.logged == {0, 1, 2, 3}
    assert log.backfill(Checkpoint(folder, 4, {}), attempt=1, logged_before={0, 1, 2}) == []  # not twice


def _write_checkpoint(run_dir: CheckpointDir, writer, step: int, new_rows: list[dict]):
    """What StepCheckpoints.write leaves of a checkpoint for the step log: its rows file (through the
    writer's own rows_through) and its manifest."""
    import pandas as pd

    from pipelines.recovery.checkpoint import STEP_ROWS

    tmp = run_dir.begin(step)
    rows = writer.rows_through(new_rows)
    (tmp / STEP_ROWS).write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_dir.commit(tmp, step, {"policy_version": step}, pd.DataFrame({"group_uid": [f"g{step}"]}))
    writer.rows = rows


def test_a_restart_logs_the_rows_of_every_checkpoint_the_driver_had_not_heard_of(tmp_path):
    """The chaos run's two missing steps: the driver reads the Train stage's rows through Ray Data's
    output queue, behind training; an attempt ended after the Train stage had written two checkpoints
    the driver had not heard of (steps 5 and 10 here, the driver at step 3). Every step before the
    newest checkpoint reaches MLflow exactly once, with the attempt that trained it, across a resume too."""
    from pipelines.recovery.checkpoint import StepCheckpoints

    run_dir = CheckpointDir(tmp_path / "run")
    writer = StepCheckpoints(str(run_dir.root), every=5, keep=1, attempt=1)  # keep 1: step 5's is pruned
    tracker = Recorder()
    log = StepLog(tracker, committed=0, attempt=1)
    for step in range(1, 5):  # the rows the driver got: steps 1..4
        log.hold({"step": step}, step)
    _write_checkpoint(run_dir, writer, 5, [{"step": s} for s in range(1, 6)])
    _write_checkpoint(run_dir, writer, 10, [{"step": s} for s in range(6, 11)])
    run_dir.prune(1)
    assert [step for step, _ in run_dir.steps()] == [10]
    checkpoint = run_dir.latest_valid()
    assert [row["attempt"] for row in checkpoint.step_rows()] == [1] * 10
    # The attempt ends (a rank died at step 11): drop, then backfill from the newest checkpoint.
    assert log.drop(checkpoint.step) == []
    assert log.backfill(checkpoint, attempt=1) == [5, 6, 7, 8, 9, 10]
    assert tracker.steps == list(range(1, 11))
    # Attempt 2 starts from that checkpoint with its rows, trains 10..14, and the driver dies (a resume).
    writer = StepCheckpoints(str(run_dir.root), every=5, attempt=2, prior_rows=checkpoint.step_rows())
    _write_checkpoint(run_dir, writer, 15, [{"step": s} for s in range(11, 16)])
    latest = run_dir.latest_valid()
    assert [row["step"] for row in latest.step_rows()] == list(range(1, 16))
    assert [row["attempt"] for row in latest.step_rows()] == [1] * 10 + [2] * 5
    resumed = Recorder()
    log = StepLog(resumed, committed=15, attempt=3)
    assert log.backfill(latest, attempt=2, logged_before=set(range(1, 13))) == [13, 14, 15]
    # A restart later in the resumed process: nothing the first process logged is logged again.
    assert log.backfill(latest, attempt=3) == []
    assert resumed.steps == [13, 14, 15]


def test_steps_trained_again_after_a_damaged_checkpoint_are_logged_once(tmp_path):
    """A resume falls back past a damaged newest checkpoint (step 8) to the one of step 4: steps 4-7 are
    trained again, but MLflow has their rows already. They are not logged a second time (with other
    values); this attempt's rows go to the artifact retrained/attempt_<n>.jsonl, and the job says so."""
    tracker, lines = Recorder(), []
    log = StepLog(tracker, committed=4, attempt=2, retrained_dir=tmp_path, echo=lines.append)
    log.backfill(None, 1, logged_before=set(range(1, 9)))  # what the run's spool and MLflow hold
    for step in range(5, 11):
        log.hold({"step": step, "policy_loss": 0.1 * step, "attempt": 2}, step)
    log.commit(10)
    assert tracker.steps == [9, 10]  # only the steps nobody logged
    assert tracker.artifacts[-1] == (str(tmp_path / "attempt_2.jsonl"), "retrained")
    assert [json.loads(line)["step"] for line in open(tmp_path / "attempt_2.jsonl")] == [5, 6, 7, 8]
    assert lines == ["streamrl: step(s) 5, 6, 7, 8 were logged to MLflow by an earlier attempt (its newer checkpoint "
                     "was damaged, so they were trained again); MLflow keeps those values, this attempt's rows are "
                     "the artifact retrained/attempt_2.jsonl"]
