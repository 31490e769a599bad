"""A chaos run: one job on a real two-node Ray cluster, faults injected at random times from a seed.

    python benchmarks/chaos.py                 # seed 0, 16 faults of 8 kinds, ~15 minutes on 2 cores
    python benchmarks/chaos.py --seed 7 --faults 6 --steps 120 --no-baseline

What it starts, all real processes on this machine: a head (`ray start --head`) and a second node
(`ray start --address`), an `mlflow server` (sqlite, proxied artifacts), and the job's driver
(`streamrl run configs/tiny_grpo.yaml --set ray.address=...`): two trainer ranks spread over the
nodes, two generate actors, a reward actor pool of its own, checkpoints every 5 steps, MLflow on the
server. First the same job runs without faults (the baseline: its wall time and success rate), then
with faults, each kind drawn from a shuffled deck so every kind comes up:

    generate  SIGKILL a generate actor's process       reward   SIGKILL a reward actor's process
    trainer   SIGKILL a trainer rank's process         mlflow   kill the MLflow server, restart it 5-15 s later
    node      SIGKILL every process of the second node (raylet included); a new node joins 20 s later
    sigterm   SIGTERM to the driver (a graceful stop, exit 75), then `streamrl run ... --resume RUN_ID`
    disk      fill the job's disk (output_dir is a 2 GiB tmpfs) to 1 MiB free; the file goes 20-40 s later
    writer    a second `streamrl run ... --resume RUN_ID` while the job runs: it must be refused (exit 2)

A fault is injected once the job has written a checkpoint newer than the newest at the previous
fault (recovered) and a random 15-35 s more (--gap-s). At the end the final checkpoint's ledger is checked: every prompt of the epoch trained
once (groups lost, groups duplicated) within the staleness bound (violations). It prints and writes
benchmarks/results/chaos.json: faults by kind, faults survived, restarts, resumes, the three counts
(all must be 0: exit 1 otherwise), and wall time and success rate against the baseline.

The cluster and server helpers are the ones the fault tests use (tests/mlflow_server.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # real-process helpers shared with the fault tests

from mlflow_server import MlflowServer, Sessions, add_node, start_head  # noqa: E402

KINDS = ("generate", "reward", "trainer", "mlflow", "node", "sigterm", "disk", "writer")
DISK_SIZE = "2g"  # the tmpfs the job's output_dir lies on: room for checkpoint_keep + 1 tiny checkpoints
GROUPS, MAX_STALENESS = 8, 1
PREEMPTED_EXIT = 75  # pipelines.recovery.preemption.PREEMPTED_EXIT (not imported: this script does not start Ray)


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


def run(folder: Path, steps: int, seed: int, faults: int, timeout_s: float, label: str,
        gap_s: tuple[float, float] = (15, 35)) -> dict:
    """One job, with `faults` faults (0: the baseline). Returns its record."""
    rng = random.Random(seed)
    deck = [KINDS[i % len(KINDS)] for i in range(faults)]
    rng.shuffle(deck)
    chaos = Chaos(folder, steps, f"{label}.log")
    started = time.monotonic()
    drivers = [Driver(chaos.argv(), chaos.log)]
    injected, resumes, pending, next_at, mlflow_back, failure = [], 0, None, None, None, None
    disk_back, writers = None, []  # the filler's remover; the second writers and their outcomes
    signalled = None  # the driver sent SIGTERM last
    print(f"[{label}] {steps} steps, {faults} fault(s) (seed {seed}); log {folder / f'{label}.log'}", flush=True)
    try:
        while True:
            time.sleep(0.5)
            now = time.monotonic() - started
            driver = drivers[-1]
            code = driver.poll()
            if code is not None:
                driver.wait()
                if code == 0:
                    if pending is not None and driver.last_step > pending["step"]:
                        pending["recovered_after_s"] = round(now - pending["at_s"], 1)
                    break
                if code == PREEMPTED_EXIT and signalled is driver:
                    pending["checkpoint"] = chaos.newest_checkpoint(drivers[0].run_id)  # the stop's: the resume's own counts
                    resumes += 1
                    drivers.append(Driver(chaos.argv(resume=drivers[0].run_id), chaos.log))
                    continue
                if signalled is driver and pending is not None and finished(chaos, drivers[0].run_id, steps):
                    # the driver prints its steps in bursts: the signal came after the last step, while it shut down
                    pending["target"] = f"skipped: the job had trained its last step (exit {code})"
                    break
                failure = f"the driver exited {code}"
                break
            if now > timeout_s:
                failure = f"still running after {timeout_s:g} s"
                break
            if pending is not None:
                # Recovered once a checkpoint newer than the newest at the fault is written: training went on
                # (after a restart or a resume, past the checkpoint it started from). The driver's step lines
                # cannot tell: it prints them in bursts, up to tens of steps after they were trained.
                # A graceful stop writes one too: after a SIGTERM, only the resumed driver's count.
                if chaos.newest_checkpoint(drivers[0].run_id) > pending["checkpoint"] and driver is not signalled:
                    pending["recovered_after_s"] = round(now - pending["at_s"], 1)
                    print(f"[{label}] recovered from {pending['kind']} in {pending['recovered_after_s']} s "
                          f"(checkpoint {chaos.newest_checkpoint(drivers[0].run_id)})", flush=True)
                    pending, next_at = None, now + rng.uniform(*gap_s)
                continue
            if not deck or driver.last_step < 3 or driver.run_id is None:
                continue
            if next_at is None:
                next_at = now + rng.uniform(*gap_s)
            if now < next_at or driver.last_step >= steps - 5:  # leave the job's end alone (a SIGTERM there ends it)
                continue
            if mlflow_back is not None:
                mlflow_back.join()
                mlflow_back = None
            if disk_back is not None:
                disk_back.join()
                disk_back = None
            kind = deck.pop()
            checkpoint_then = chaos.newest_checkpoint(drivers[0].run_id)
            if kind == "generate":
                target = chaos.sigkill_actor("(Generate)", rng)
            elif kind == "reward":
                target = chaos.sigkill_actor("(Reward)", rng)
            elif kind == "trainer":
                target = chaos.sigkill_actor("TrainWorker", rng)
            elif kind == "mlflow":
                target, mlflow_back = chaos.restart_mlflow(rng)
            elif kind == "node":
                target = chaos.kill_node()
            elif kind == "disk":
                target, disk_back = chaos.fill_disk(rng)
            elif kind == "writer":
                target, waiter = chaos.second_writer(drivers[0].run_id)
                writers.append(waiter)
            else:
                os.kill(driver.proc.pid, signal.SIGTERM)
                target, signalled = f"driver pid {driver.proc.pid}", driver
            pending = {"kind": kind, "at_s": round(now, 1), "step": driver.last_step, "target": target,
                       "checkpoint": checkpoint_then}
            injected.append(pending)
            print(f"[{label}] {now:6.1f} s  step {driver.last_step:4d}  {kind:8s} {target}", flush=True)
        wall = time.monotonic() - started
        if mlflow_back is not None:
            mlflow_back.join()
        for waiter in writers:
            waiter.join()
            if not (waiter.result.get("code") == 2 and waiter.result.get("refused")) and failure is None:
                failure = f"a second writer was not refused: {waiter.result}"
        return {**outcome(chaos, drivers[0].run_id, steps), "wall_s": round(wall, 1), "failure": failure,
                "faults": injected, "resumes": resumes, "restarts": sum(d.restarts for d in drivers),
                "second_writers": [waiter.result for waiter in writers]}
    finally:
        for driver in drivers:
            if driver.poll() is None:
                driver.kill()
        chaos.close()


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", type=int, default=16, help="faults to inject (kinds dealt in turn, shuffled)")
    parser.add_argument("--steps", type=int, default=200, help="train steps of the job (8 groups of 8 each)")
    parser.add_argument("--timeout-s", type=float, default=1800, help="give up on a run after this long")
    parser.add_argument("--gap-s", default="15-35", help="seconds between a recovery and the next fault (min-max)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the fault-free run")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "chaos.json"))
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="srl-chaos-", dir="/tmp"))  # short: Ray's socket paths
    record = {
        "command": "python benchmarks/chaos.py " + " ".join(sys.argv[1:]), "seed": args.seed, "steps": args.steps,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    try:
        if not args.no_baseline:
            record["baseline"] = run(folder / "baseline", args.steps, args.seed, 0, args.timeout_s, "baseline")
        gap = tuple(float(part) for part in args.gap_s.split("-"))
        record["chaos"] = chaos = run(folder / "chaos", args.steps, args.seed, args.faults, args.timeout_s, "chaos", gap)
    finally:
        for name in ("baseline", "chaos"):  # keep the logs beside the record
            if (folder / name / f"{name}.log").exists():
                shutil.copy(folder / name / f"{name}.log", Path(args.output).with_suffix(f".{name}.log"))
        shutil.rmtree(folder, ignore_errors=True)
    faults = chaos["faults"]
    chaos["faults_by_kind"] = dict(Counter(fault["kind"] for fault in faults))
    chaos["faults_injected"] = sum(1 for fault in faults if not fault["target"].startswith("skipped"))
    chaos["faults_survived"] = (sum(1 for fault in faults if "recovered_after_s" in fault)
                                if chaos["failure"] is None else 0)
    if "baseline" in record:
        record["wall_time_cost"] = round(chaos["wall_s"] / record["baseline"]["wall_s"], 2)
        record["success_last10_delta"] = round(chaos["success_last10"] - record["baseline"]["success_last10"], 3)
    Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({key: value for key, value in record.items() if key != "chaos"}, indent=2))
    print(json.dumps({key: value for key, value in chaos.items() if key != "faults"}, indent=2))
    clean = chaos["failure"] is None and all(chaos.get(key) == 0 for key in
                                             ("groups_lost", "groups_duplicated", "staleness_violations"))
    sys.exit(0 if clean else 1)


if __name__ == "__main__":
    main()
