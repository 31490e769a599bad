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

The cluster, server and job are benchmarks/chaos_cluster.py's; its helpers are the ones the fault tests use
(benchmarks/real_servers.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.chaos_cluster import Chaos, Driver, finished, outcome

ROOT = Path(__file__).resolve().parents[1]

KINDS = ("generate", "reward", "trainer", "mlflow", "node", "sigterm", "disk", "writer")
PREEMPTED_EXIT = 75  # pipelines.recovery.preemption.PREEMPTED_EXIT (not imported: this script does not start Ray)


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
    from benchmarks.command_line import run_command

    sys.exit(run_command(main))
