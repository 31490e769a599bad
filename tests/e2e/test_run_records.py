"""Records a run must not lose on shared clusters and full disks (issue 29, items 12-15):
one writer per run (a lease with a heartbeat and a fencing token), no prune of a checkpoint MLflow
does not have yet, and a full disk met with the space needed and a wait, not a crash.

The full-disk tests mount a real tmpfs of a few MiB (the machines run tests as root); where mounting
is not permitted they are skipped with the reason. The job-level proof, with a disk filled under a
running job and a second writer started beside it, is `python benchmarks/chaos.py`.
"""

from __future__ import annotations

import errno
import json
import subprocess
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from operators.common.durable import MIB, DiskFullError, write_atomic, write_json_atomic
from pipelines.recovery.checkpoint import CheckpointDir, StepCheckpoints, step_dir_name
from pipelines.config.base import ConfigError
from pipelines.config.load import load_config
from pipelines.tracking.tracker import Tracker
from pipelines.recovery.resume import AttemptFailed, is_disk_full_failure
from pipelines.recovery.run_lease import LeaseHeld, LeaseLost, RunLease


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs, unmounted after the test."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); the full-disk tests need one")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path, leave_bytes: int) -> Path:
    """Fill `disk` up to `leave_bytes` free with one file; returns it (delete it to free the space)."""
    import shutil

    filler = disk / "filler"
    with open(filler, "wb") as handle:
        try:
            handle.write(b"\0" * max(shutil.disk_usage(disk).free - leave_bytes, 0))
        except OSError as err:
            assert err.errno == errno.ENOSPC
    return filler


def fake_checkpoint(run_dir: CheckpointDir, step: int, size: int) -> Path:
    path = run_dir.root / step_dir_name(step)
    path.mkdir(parents=True)
    (path / "weights.bin").write_bytes(b"\1" * size)
    return path


# --- 12: two writers on one run ------------------------------------------------------------------------

def test_a_second_writer_is_refused_while_the_first_lives_and_takes_over_a_dead_one(tmp_path):
    folder = tmp_path / "run"
    lines: list[str] = []
    first = RunLease(folder, ttl_s=0.6, echo=lines.append).acquire()
    assert first.token == 1 and json.loads((folder / "lease.json").read_text())["token"] == 1
    with pytest.raises(LeaseHeld, match=r"is being written by pid \d+ on "):
        RunLease(folder, ttl_s=0.6, echo=lines.append).acquire()  # its heartbeat moves: alive
    assert any("waiting up to 0.6s to see whether it is alive" in line for line in lines)
    first.fence.check()  # still the holder

    first._stop.set()  # the first writer hangs (a stalled process): no heartbeat, no release
    first._beat.join()
    second = RunLease(folder, ttl_s=0.6, echo=lines.append).acquire()
    assert second.token == 2
    assert any(line.startswith("streamrl: took over run run from pid ") for line in lines)
    with pytest.raises(LeaseLost, match="another process took over this run"):
        first.fence.check()  # what the Train operator checks before it commits a checkpoint
    second.fence.check()
    second.release()
    third = RunLease(folder, ttl_s=0.6, echo=lines.append).acquire()  # a released lease is free at once
    assert third.token == 3
    third.release()


def test_the_heartbeat_notices_a_lost_lease(tmp_path):
    folder = tmp_path / "run"
    first = RunLease(folder, ttl_s=0.3).acquire()
    lease = json.loads((folder / "lease.json").read_text())
    write_json_atomic(folder / "lease.json", {**lease, "token": 7, "pid": 1, "owner": "other"})  # taken over
    deadline = time.monotonic() + 5
    while first.lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(LeaseLost, match="took over run run"):
        first.check()
    first.release()
    assert json.loads((folder / "lease.json").read_text())["token"] == 7  # the loser does not write it back


def test_resume_while_another_process_writes_the_run_is_refused_and_touches_nothing(tmp_path, tiny_model_path):
    from pipelines.recovery.checkpoint import dataset_digest
    from pipelines.data.datasets import load_prompts
    from pipelines.dag import schedule_groups
    from pipelines.job import run_job
    from pipelines.recovery.resume import run_file_info

    cfg = load_config("configs/tiny_grpo.yaml", [f"output_dir={tmp_path}", "tracking.enabled=false",
                                                 f"model.path={tiny_model_path}", "train.steps=4"])
    prompts, _ = load_prompts(cfg.data)
    schedule_groups(prompts, cfg)
    run_dir = CheckpointDir.of_run(tmp_path, "local-run-1")
    run_dir.write_run_file(run_file_info(cfg, "local-run-1", dataset_digest(prompts), time.time(), 0))
    in_progress = run_dir.root / ".tmp-step_000002-abcd1234"  # the live writer's checkpoint being written
    in_progress.mkdir()
    holder = RunLease(run_dir.root, ttl_s=1.0).acquire()  # the live writer (this process stands in for it)
    try:
        with pytest.raises(ConfigError, match=r"--resume: run local-run-1 is being written by pid \d+"):
            run_job(cfg, echo=lambda line: None, resume="latest")
        assert in_progress.is_dir()  # not removed as a dead job's partial checkpoint
    finally:
        holder.release()


# --- 13: no prune of what MLflow does not have ----------------------------------------------------------

def test_prune_keeps_checkpoints_whose_upload_is_not_delivered(tmp_path):
    run_dir = CheckpointDir(tmp_path / "run")
    for step in (5, 10, 15, 20):
        fake_checkpoint(run_dir, step, 10)
    run_dir.mark_uploaded(10)
    assert run_dir.prune(keep=1, require_uploaded=True) == [run_dir.root / "step_000010"]
    assert [step for step, _ in run_dir.steps()] == [5, 15, 20]  # 5 and 15 wait for their upload
    assert not run_dir.uploaded(10)  # its marker goes with it
    assert run_dir.prune(keep=1) == [run_dir.root / "step_000005", run_dir.root / "step_000015"]  # tracking off


def test_the_tracker_marks_a_checkpoint_uploaded_once_its_files_are_delivered(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path / 'out'}", f"tracking.uri=sqlite:///{tmp_path / 'db'}",
                             "data.num_prompts=8"])
    from pipelines.data.datasets import load_prompts

    prompts, source = load_prompts(cfg.data)
    tracker = Tracker(cfg, prompts, source, echo=lambda line: None)
    run_dir = CheckpointDir(tmp_path / "out" / "checkpoints" / tracker.run_id)
    path = fake_checkpoint(run_dir, 5, 100)
    tracker.log_checkpoint(path, 5)
    assert tracker.flush(60)
    assert run_dir.uploaded(5)
    tracker.close()


# --- 15: a full disk ------------------------------------------------------------------------------------

def test_an_atomic_write_on_a_full_disk_says_what_it_needs_and_leaves_nothing(small_disk):
    fill(small_disk, 64 * 1024)
    with pytest.raises(DiskFullError, match=r"the rollouts of step 3 needs about 1\.\d MiB at .*disk, and 0\.\d "
                                            r"MiB are free there; free space on that disk"):
        write_atomic(small_disk / "step_000002.parquet", b"x" * (512 * 1024), what="the rollouts of step 3")
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]  # no temporary left behind


def test_short_of_room_the_oldest_checkpoint_goes_before_the_write_then_the_need_is_said(small_disk):
    run_dir = CheckpointDir(small_disk / "run")
    for step in (5, 10):
        fake_checkpoint(run_dir, step, 1 * MIB)
        run_dir.mark_uploaded(step)
    filler = fill(small_disk, 1 * MIB)  # 1 MiB free; a checkpoint needs 1.1
    writer = StepCheckpoints(str(run_dir.root), every=5, keep=2, prune_uploaded_only=True)
    writer._make_room(run_dir, 15)  # prunes step 5 first: then it fits
    assert [step for step, _ in run_dir.steps()] == [10]
    filler.write_bytes(b"\0" * (2 * MIB + 512 * 1024))  # now 0.5 MiB free, and nothing left to prune
    with pytest.raises(DiskFullError, match=r"the checkpoint of step 15 needs about 1\.1 MiB at .*run, and 0\.\d MiB"):
        writer._make_room(run_dir, 15)
    assert [step for step, _ in run_dir.steps()] == [10]  # keep - 1 = 1 stays: never below one checkpoint


def test_a_full_disk_fails_the_attempt_as_restartable_and_the_job_waits_for_room(small_disk):
    from pipelines.recovery.attempts import wait_for_space

    failure = AttemptFailed.from_exception(DiskFullError(errno.ENOSPC, "the checkpoint of step 10 needs ..."))
    assert is_disk_full_failure(failure) and not failure.process_death
    assert not is_disk_full_failure(AttemptFailed.from_exception(ValueError("bad numbers")))
    run_dir = CheckpointDir(small_disk / "run")
    fake_checkpoint(run_dir, 5, 1 * MIB)
    filler = fill(small_disk, 256 * 1024)
    lines: list[str] = []
    with pytest.raises(AttemptFailed):
        wait_for_space(run_dir, 0.5, lines.append, failure)  # no room comes: the failure stands
    assert lines[0].startswith("streamrl: disk full: the next checkpoint needs about 1.1 MiB at ")
    threading.Timer(1.0, filler.unlink).start()  # another job's files go away
    wait_for_space(run_dir, 30, lines.append, failure)
    assert lines[-1].endswith(f"MiB free at {run_dir.root} again")


def test_a_spool_that_hits_a_full_disk_keeps_the_records_in_memory_and_delivers_them(small_disk, tmp_path):
    from mlflow.tracking import MlflowClient

    from pipelines.data.datasets import load_prompts

    cfg = load_config(None, [f"output_dir={small_disk / 'out'}", f"tracking.uri=sqlite:///{tmp_path / 'db'}",
                             "data.num_prompts=8"])
    prompts, source = load_prompts(cfg.data)
    lines: list[str] = []
    tracker = Tracker(cfg, prompts, source, echo=lines.append)
    tracker.log_step({"step": 0, "reward_mean": 0.5})  # a spool line
    assert tracker.flush(60)
    filler = fill(small_disk, 0)
    full = "is full (No space left on device); MLflow records are held in memory"
    step = 0
    while not any(full in line for line in lines) and step < 500:  # the spool file's last page fills first
        step += 1
        tracker.log_step({"step": step, "reward_mean": 0.5 + step})  # used to raise ENOSPC in the driver
    assert any(full in line for line in lines)
    last = step + 3
    for step in range(step + 1, last + 1):
        tracker.log_step({"step": step, "reward_mean": 0.5 + step})
    filler.unlink()
    tracker.log_step({"step": last + 1, "reward_mean": 0.5})  # a spool line again
    assert tracker.flush(60)
    history = MlflowClient(cfg.tracking_uri()).get_metric_history(tracker.run_id, "reward_mean")
    assert sorted(m.step for m in history) == list(range(last + 2))
    spool = small_disk / "out" / "mlflow_spool" / f"{tracker.run_id}.jsonl"
    spooled = [json.loads(line)["step"] for line in spool.read_text().splitlines()]
    assert spooled[-1] == last + 1 and len(spooled) < last + 2  # the records held in memory are not in it...
    assert spool.with_suffix(".delivered").read_text() == str(len(spooled))  # ...nor counted as its lines
    tracker.close()
