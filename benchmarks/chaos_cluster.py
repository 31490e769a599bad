"""The chaos run's cluster, server and job (benchmarks/chaos.py): `Chaos` starts a two-node Ray cluster of
real processes, an MLflow server and the job's driver (`Driver`), injects each kind of fault, and reads
what the job left (`finished`, `outcome`: the final checkpoint's ledger and the MLflow run).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.real_servers import MlflowServer, Sessions, add_node, start_head

ROOT = Path(__file__).resolve().parents[1]
DISK_SIZE = "2g"  # the tmpfs the job's output_dir lies on: room for checkpoint_keep + 1 tiny checkpoints
GROUPS, MAX_STALENESS = 8, 1


class Driver:
    """`streamrl run` in a process of its own (its own session), its output read by a thread: the last step
    it reported, its run id, the restarts it announced."""

    def __init__(self, argv: list[str], log):
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log, self.last_step, self.run_id, self.restarts, self.lines = log, 0, None, 0, []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self.log.write(line)
            self.log.flush()
            if match := re.match(r"step\s+(\d+)/", line):
                self.last_step = int(match.group(1))
            elif self.run_id is None and (match := re.search(r"MLflow run (\w+)", line)):
                self.run_id = match.group(1)
            elif "restarting the trainer group and the DAG" in line:
                self.restarts += 1

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout_s: float | None = None) -> int:
        code = self.proc.wait(timeout_s)
        self.reader.join(timeout=30)
        return code

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Chaos:
    """The cluster, the server and the job of one run (the baseline or the chaos run)."""

    def __init__(self, folder: Path, steps: int, log_name: str):
        folder.mkdir(parents=True)
        self.sessions = Sessions(folder)
        self.steps, self.folder = steps, folder
        self.log = open(folder / log_name, "w")
        self.mlflow = MlflowServer(self.sessions)
        self.mlflow.start()
        # CPUs are logical: the head holds the whole job (after a node loss it runs alone), the second
        # node a trainer rank (placement SPREAD) and a generate actor.
        self.cluster = start_head(self.sessions, cpus=6)
        self.nodes = [add_node(self.sessions, self.cluster, "node1", cpus=2)]
        self.replacing: threading.Thread | None = None
        self.out = folder / "job"
        self.out.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE}", "tmpfs", str(self.out)],
                                 capture_output=True, text=True)
        self.disk = mounted.returncode == 0  # the disk fault needs a disk of its own to fill
        if not self.disk:
            print(f"chaos: cannot mount a tmpfs for the job ({mounted.stderr.strip()}); disk faults are skipped")
        self.sets = {
            "train.steps": steps, "train.groups_per_step": GROUPS, "data.num_prompts": steps * GROUPS,
            "rollout.n": 8, "rollout.num_actors": 2, "rollout.num_cpus": 0.5, "reward.placement": "stage",
            "reward.num_actors": 1, "reward.num_cpus": 0.25, "train.world_size": 2, "train.placement": "SPREAD",
            "train.max_staleness": MAX_STALENESS, "train.checkpoint_every": 5, "train.checkpoint_keep": 3,
            "train.max_restarts": 100, "train.node_wait_s": 120, "rollout.replace_wait_s": 60,
            "tracking.uri": self.mlflow.uri, "output_dir": str(self.out),
            "ray.address": f"{self.cluster['node_ip']}:{self.cluster['gcs']}",
        }

    def argv(self, resume: str | None = None) -> list[str]:
        argv = [sys.executable, "-m", "pipelines.cli", "run", "configs/tiny_grpo.yaml"]
        argv += [part for key, value in self.sets.items() for part in ("--set", f"{key}={value}")]
        return argv + (["--resume", resume] if resume else [])

    def close(self) -> None:
        self.log.close()
        self.sessions.stop()
        if self.disk:
            subprocess.run(["umount", "-l", str(self.out)], check=False)

    def newest_checkpoint(self, run_id: str) -> int:
        """The step of the newest committed checkpoint (folders appear whole: an atomic rename)."""
        steps = [int(path.name.split("_")[1]) for path in (self.out / "checkpoints" / run_id).glob("step_*")
                 if path.name.split("_")[1].isdigit()]
        return max(steps, default=0)

    # -- the faults -----------------------------------------------------------------------------------
    def actor_pids(self, class_part: str) -> list[int]:
        from ray.util.state import list_actors

        actors = list_actors(address=self.cluster["address"], filters=[("state", "=", "ALIVE")], limit=1000,
                             raise_on_missing_output=False)  # a dead node's entries are 'missing'
        return sorted(actor.pid for actor in actors if class_part in actor.class_name and actor.pid)

    def sigkill_actor(self, class_part: str, rng: random.Random) -> str:
        deadline = time.monotonic() + 30  # during a restart there may be none for a while
        while time.monotonic() < deadline:
            pids = self.actor_pids(class_part)
            if pids:
                pid = rng.choice(pids)
                os.kill(pid, signal.SIGKILL)
                return f"pid {pid}"
            time.sleep(1)
        return "skipped: none alive"

    def kill_node(self) -> str:
        if self.replacing is not None:  # the node that replaces the last one lost must have joined
            self.replacing.join()
        node = self.nodes.pop()
        self.sessions.kill_session(node["session"])

        def replace():  # an autoscaler (or the machine coming back) gives the cluster a node again
            time.sleep(20)
            self.nodes.append(add_node(self.sessions, self.cluster, f"node{len(self.sessions.procs)}", cpus=2))

        self.replacing = threading.Thread(target=replace, daemon=True)
        self.replacing.start()
        return f"node {node['node_id'][:8]}"

    def fill_disk(self, rng: random.Random) -> tuple[str, threading.Thread | None]:
        """Fill the job's disk to 1 MiB free with one file (another job's), removed 20-40 s later."""
        if not self.disk:
            return "skipped: no tmpfs", None
        filler = self.out / "filler.bin"
        with open(filler, "wb") as handle:
            try:
                handle.write(b"\0" * max(shutil.disk_usage(self.out).free - 2**20, 0))
            except OSError:  # the job wrote meanwhile: full is what we want
                pass
        full_s = rng.uniform(20, 40)

        def clear():
            time.sleep(full_s)
            filler.unlink()

        thread = threading.Thread(target=clear, daemon=True)
        thread.start()
        return f"full for {full_s:.0f} s", thread

    def second_writer(self, run_id: str) -> tuple[str, threading.Thread]:
        """`streamrl run --resume RUN_ID` beside the live job: refused (exit 2) without touching the run."""
        second = Driver(self.argv(resume=run_id), self.log)
        result = {}

        def wait():
            result["code"] = second.wait(300)
            result["refused"] = any("is being written by" in line for line in second.lines)

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        thread.result = result
        return f"driver pid {second.proc.pid}", thread

    def restart_mlflow(self, rng: random.Random) -> tuple[str, threading.Thread]:
        self.mlflow.stop()
        down_s = rng.uniform(5, 15)

        def back():
            time.sleep(down_s)
            self.mlflow.start()

        thread = threading.Thread(target=back, daemon=True)
        thread.start()
        return f"down {down_s:.0f} s", thread


def finished(chaos: Chaos, run_id: str | None, steps: int) -> bool:
    from pipelines.recovery.checkpoint import CheckpointDir

    checkpoint = CheckpointDir.of_run(chaos.out, run_id).latest_valid() if run_id else None
    return checkpoint is not None and checkpoint.step == steps


def outcome(chaos: Chaos, run_id: str | None, steps: int) -> dict:
    """What the final checkpoint's ledger and the MLflow run say."""
    import mlflow

    from pipelines.recovery.checkpoint import CheckpointDir

    if run_id is None:
        return {"ledger": None}
    checkpoint = CheckpointDir.of_run(chaos.out, run_id).latest_valid()
    ledger = checkpoint.ledger() if checkpoint is not None else None
    expected = {f"arith-{index:05d}" for index in range(steps * GROUPS)}
    record = {"run_id": run_id, "final_checkpoint_step": checkpoint.step if checkpoint else None}
    if ledger is not None:
        present = set(ledger["prompt_id"])
        staleness = ledger["train_step"] - ledger["policy_version"]
        record.update(
            groups_trained=int(len(ledger)),
            groups_lost=len(expected - present),
            groups_duplicated=int(len(ledger) - ledger["prompt_id"].nunique()
                                  + len(ledger) - ledger["group_uid"].nunique()),
            staleness_violations=int(((staleness < 0) | (staleness > MAX_STALENESS)
                                      | (ledger["staleness"] != staleness)).sum()),
            generators=int(ledger["generator_id"].nunique()),
        )
    client = mlflow.MlflowClient(tracking_uri=chaos.mlflow.uri)
    success = [m.value for m in sorted(client.get_metric_history(run_id, "success_rate"), key=lambda m: m.step)]
    held_out = sorted(client.get_metric_history(run_id, "eval/success_rate"), key=lambda m: m.step)
    steps_logged = [m.step for m in client.get_metric_history(run_id, "success_rate")]
    run = client.get_run(run_id)
    record.update(
        mlflow_status=run.info.status,
        steps_in_mlflow=len(steps_logged), steps_logged_twice=len(steps_logged) - len(set(steps_logged)),
        success_first10=round(sum(success[:10]) / max(len(success[:10]), 1), 3),
        success_last10=round(sum(success[-10:]) / max(len(success[-10:]), 1), 3),
        heldout_success_end=round(held_out[-1].value, 3) if held_out else None,
    )
    return record
