"""Latency of the RL loop itself, hop by hop: where a step's wall time goes when its compute is tiny.

    python benchmarks/loop_latency.py [CONFIG] [--set key=value ...] [--label after] [--skip 10]

Runs the job (default: the README's configs/tiny_grpo.yaml, MLflow and evaluation included) in
this process and reads the wall-clock stamps each group collects on its way (Generate,
Reward, the Train operator's arrival; kept per step in the metrics' `timeline`).
At max_staleness η the loop is: train step s-η-1 publishes the version step s needs ->
the gated generate call starts -> generate -> reward -> advantage -> Train has the step's
last group -> train step s (compute, publish). Per hop it prints the median over the
steady-state steps (the first `--skip` are start-up), and the step time (median gap between
two train steps' ends). It also samples every process's CPU time (/proc, Linux) and prints the CPU ms
per step of each over the same steps: the whole machine's, the job's processes and anything else.

Writes benchmarks/results/loop_latency.json, keeping the other labels there (e.g. `before`
and `after` a change); wrap timing runs in `flock /tmp/streamrl-bench.lock` on shared machines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "loop_latency.json"

# (name, what it measures); each is computed per step by `hops`.
HOPS = [
    ("publish_to_generate", "train step s-η-1 published -> the first generate call of step s starts (admitted)"),
    ("generate", "generate calls of the step, first start -> last end (includes gaps between its calls)"),
    ("generate_call_gap", "between two generate calls of a step: one ends -> the next starts"),
    ("generate_to_reward", "generate call ends -> reward call starts (per group)"),
    ("reward", "reward call, start -> end (per group)"),
    ("reward_to_train", "reward ends -> the Train operator has the group, advantage on the way (per group)"),
    ("last_group_to_train_start", "the Train operator has the step's last group -> the train step starts"),
    ("train", "train step compute, weights published included"),
    ("generate_end_to_train_start", "the step's last generate call ends -> its train step starts"),
    ("loop_trip", "the whole trip: publish of version s-η -> train step s ends (covers η+1 steps)"),
    ("step", "step time: one train step's end -> the next one's"),
    ("train_to_driver", "train step ends -> the driver has its metrics row (not on the loop's path)"),
]


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _gaps(ends: list[float | None], starts: list[float | None]) -> list[float]:
    return [s - e for e, s in zip(ends, starts) if e is not None and s is not None]


def hops(timelines: list[dict], max_staleness: int, driver_times: dict[int, float], skip: int) -> dict[str, dict]:
    """Per hop: the median over steps >= skip (seconds), and how many values it is taken over."""
    per_hop: dict[str, list[float]] = {name: [] for name, _ in HOPS}
    train = [tuple(t["train"]) for t in timelines]
    for step in range(skip, len(timelines)):
        stamps = timelines[step]["stamps"]
        calls = sorted(timelines[step]["generate"], key=lambda call: call[1])  # (generator, start, end)
        gate = step - max_staleness - 1  # the train step whose published version admits this step
        if gate >= 0:
            per_hop["publish_to_generate"].append(calls[0][1] - train[gate][1])
            per_hop["loop_trip"].append(train[step][1] - train[gate][1])
        per_hop["generate"].append(max(c[2] for c in calls) - calls[0][1])
        per_hop["generate_call_gap"] += [b[1] - a[2] for a, b in zip(calls, calls[1:])]
        per_hop["generate_to_reward"] += _gaps(stamps["generate_end"], stamps["reward_start"])
        per_hop["reward"] += _gaps(stamps["reward_start"], stamps["reward_end"])
        per_hop["reward_to_train"] += _gaps(stamps["reward_end"], stamps["train_arrive"])
        arrivals = [a for a in stamps["train_arrive"] if a is not None]
        if arrivals:
            per_hop["last_group_to_train_start"].append(train[step][0] - max(arrivals))
        per_hop["generate_end_to_train_start"].append(train[step][0] - max(c[2] for c in calls))
        per_hop["train"].append(train[step][1] - train[step][0])
        if step > 0:
            per_hop["step"].append(train[step][1] - train[step - 1][1])
        if step in driver_times:
            per_hop["train_to_driver"].append(driver_times[step] - train[step][1])
    return {name: {"median_s": _median(values), "count": len(values)} for name, values in per_hop.items()}


# The sampler runs in a process of its own: a thread of the driver would share the GIL with Ray Data's
# executor, slowing it, and would itself get few turns while the driver is busy. It prints one JSON line per
# sample: the time and, per process, [utime + stime in clock ticks, the command line's words or the name].
_SAMPLER = r"""
import json, os, sys, time
interval, tick = float(sys.argv[1]), os.sysconf("SC_CLK_TCK")
while True:
    procs = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(entry.path + "/stat") as f:
                stat = f.read()
            with open(entry.path + "/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        procs[entry.name] = [(int(fields[11]) + int(fields[12])) / tick,
                             argv[:3] or [stat[stat.find("(") + 1:stat.rfind(")")]]]
    print(json.dumps({"t": time.time(), "procs": procs}), flush=True)
    time.sleep(interval)
"""


class ProcessCPU:
    """Every `interval` s, the CPU seconds (user + system, all threads) of every process on the machine, from
    /proc (Linux; elsewhere it records nothing), sampled by a child process. `per_step` turns two samples into
    CPU ms per step per process: where the cores go while the loop runs, the job's own and anything else."""

    def __init__(self, interval: float = 0.2):
        self.interval = interval
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []  # (time.time(), pid -> (name, cpu s))
        self._child: subprocess.Popen | None = None

    def start(self) -> None:
        if Path("/proc/self/stat").exists():
            self._out = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: nobody reads it until stop()
            self._child = subprocess.Popen([sys.executable, "-c", _SAMPLER, str(self.interval)], stdout=self._out)

    def stop(self) -> None:
        if self._child is None:
            return
        self._child.terminate()
        self._child.wait()
        self._out.seek(0)
        out, self._out = self._out.read(), self._out.close()
        for line in out.splitlines():
            try:
                sample = json.loads(line)
            except json.JSONDecodeError:  # the last line, cut by the termination
                continue
            self.samples.append((sample["t"], {int(pid): (self._label(int(pid), argv), cpu)
                                               for pid, (cpu, argv) in sample["procs"].items()
                                               if int(pid) != self._child.pid}))

    @staticmethod
    def _label(pid: int, argv: list[str]) -> str:
        if pid == os.getpid():
            return "driver (this process)"
        first = argv[0]
        if first.startswith("ray::"):
            return first.split(".")[0]  # ray::Actor(...).method -> the actor
        if Path(first).name.startswith("python") and len(argv) > 1:
            module = next((word for word in argv[1:] if not word.startswith("-")), "")
            return f"python {Path(module).name}"
        return Path(first).name

    def per_step(self, start: float, end: float, steps: int) -> dict:
        """CPU ms per step of each process (by name, summed) between the samples nearest `start` and `end`."""
        inside = [sample for sample in self.samples if start <= sample[0] <= end]
        if len(inside) < 2 or steps <= 0:
            return {}
        (t0, first), (t1, last) = inside[0], inside[-1]
        steps_in = steps * (t1 - t0) / (end - start)  # the samples cover this share of the window's steps
        by_name: dict[str, float] = {}
        for pid, (name, cpu) in last.items():
            used = cpu - (first[pid][1] if pid in first else 0.0)
            if used > 0:
                by_name[name] = by_name.get(name, 0.0) + used
        ranked = sorted(by_name.items(), key=lambda item: -item[1])
        return {"window_s": round(t1 - t0, 2), "cores": round(sum(by_name.values()) / (t1 - t0), 2),
                "ms_per_step": {name: round(1000 * used / steps_in, 1) for name, used in ranked
                                if used / (t1 - t0) > 0.005},  # processes busy 0.5% of a core or more
                "ms_per_step_total": round(1000 * sum(by_name.values()) / steps_in, 1)}


def run(config: str, overrides: list[str]) -> tuple[list[dict], dict[int, float], dict, ProcessCPU]:
    """Run the job; its timelines in step order, when the driver had each step's row, the summary, and the
    machine's CPU use sampled meanwhile."""
    import pipelines.job as grpo
    import pipelines.recovery.attempts as attempts  # where the job's loop reads the DAG's rows
    from pipelines.config.load import load_config

    with tempfile.TemporaryDirectory(prefix="loop-latency-") as output_dir:
        cfg = load_config(config, [f"output_dir={output_dir}", *overrides])
        driver_times: dict[int, float] = {}
        iter_steps = attempts.iter_steps

        def stamped(ds):  # when the driver has each step's row
            for row in iter_steps(ds):
                driver_times[int(row["step"]) - 1] = time.time()  # rows count steps from 1; timelines are indexed from 0
                yield row

        attempts.iter_steps = stamped
        cpu = ProcessCPU()
        cpu.start()
        try:
            start = time.perf_counter()
            result = grpo.run_job(cfg, echo=lambda line: None)
            wall = time.perf_counter() - start
        finally:
            attempts.iter_steps = iter_steps
            cpu.stop()
    metrics = result.metrics.sort_values("step")
    first, last = metrics.head(10), metrics.tail(10)
    summary = {
        "job_wall_s": round(wall, 1),
        "steps": len(metrics),
        "max_staleness": cfg.train.max_staleness,
        "success_first10": round(float(first["success_rate"].mean()), 3),
        "success_last10": round(float(last["success_rate"].mean()), 3),
        "staleness_max": int(metrics["staleness_max"].max()),
    }
    return [json.loads(t) for t in metrics["timeline"]], driver_times, summary, cpu


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default=str(Path(__file__).parents[1] / "configs" / "tiny_grpo.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--label", default="after", help="the entry of the results file to write (default: after)")
    parser.add_argument("--skip", type=int, default=10, help="start-up steps left out of the medians")
    parser.add_argument("--no-save", dest="save", action="store_false", help="print only")
    args = parser.parse_args()
    timelines, driver_times, summary, cpu = run(args.config, args.overrides)
    if len(timelines) <= args.skip + 1:
        sys.exit(f"only {len(timelines)} steps: run more than --skip {args.skip} + 1")
    figures = hops(timelines, summary["max_staleness"], driver_times, args.skip)
    print(f"{'hop':<28} {'median ms':>10} {'n':>5}  what")
    for name, text in HOPS:
        value = figures[name]["median_s"]
        shown = "-" if value is None else f"{value * 1000:.1f}"
        print(f"{name:<28} {shown:>10} {figures[name]['count']:>5}  {text}")
    # CPU per step of every process over the steady-state steps (start-up left out), evaluations included
    cpu_use = cpu.per_step(timelines[args.skip]["train"][1], timelines[-1]["train"][1],
                           len(timelines) - 1 - args.skip)
    if cpu_use:
        print(f"CPU over {cpu_use['window_s']} s of steady state: {cpu_use['cores']} cores busy, "
              f"{cpu_use['ms_per_step_total']} CPU ms per step")
        for name, ms in cpu_use["ms_per_step"].items():
            print(f"  {ms:7.1f} ms/step  {name}")
    print(json.dumps(summary))
    if not args.save:
        return
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results[args.label] = {
        "command": " ".join(["python", "benchmarks/loop_latency.py", *sys.argv[1:]]),
        "config": args.config, "overrides": args.overrides, "skip": args.skip, "commit": _git_commit(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "hops_median_s": {name: figures[name]["median_s"] for name, _ in HOPS},
        "hops_count": {name: figures[name]["count"] for name, _ in HOPS},
        **summary,
        "cpu": cpu_use,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS} [{args.label}]")


if __name__ == "__main__":
    from benchmarks.command_line import run_command

    sys.exit(run_command(main))
