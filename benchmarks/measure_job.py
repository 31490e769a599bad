"""Run a streamrl job as a subprocess and measure it: wall time, and the peak memory of
all its processes together (driver, Ray's GCS/raylet, every worker and actor).

    python benchmarks/measure_job.py configs/tiny_grpo.yaml [--set key=value ...]

Memory is sampled every 0.5 s over the process tree. RSS counts shared pages once per
process (an over-estimate); PSS splits shared pages between the processes that map them
(the honest total). Prints a summary and writes benchmarks/results/job_<name>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from benchmarks.command_line import EXIT_BAD_CONFIG, BadConfig, check_config


def tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def sample(root: psutil.Process) -> tuple[int, int, int]:
    rss = pss = count = 0
    for proc in tree(root):
        try:
            info = proc.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
        count += 1
    return rss, pss, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--name", default=None, help="result file suffix (default: config stem)")
    args = parser.parse_args()
    check_config(args.config, args.overrides)
    command = [sys.executable, "-m", "pipelines.cli", "run", args.config]
    for item in args.overrides:
        command += ["--set", item]
    peak = {"rss": 0, "pss": 0, "processes": 0}
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root = psutil.Process(proc.pid)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            rss, pss, count = sample(root)
            if pss > peak["pss"]:
                peak.update(pss=pss, rss_at_peak_pss=rss)
            peak["rss"] = max(peak["rss"], rss)
            peak["processes"] = max(peak["processes"], count)
            done.wait(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
    code = proc.wait()
    done.set()
    watcher.join()
    if code == EXIT_BAD_CONFIG:  # refused before it started (its message is above): no measurement to record
        raise BadConfig("")
    wall = time.perf_counter() - start
    summary = next((l for l in reversed(lines) if "success rate first 10" in l), "")
    numbers = re.findall(r"(\d+\.\d+)", summary)
    held_out = next((l for l in reversed(lines) if "held-out success (eval)" in l), "")
    held_numbers = re.findall(r"(\d+\.\d+)", held_out)
    result = {
        "command": " ".join(command),
        "exit_code": code,
        "wall_seconds": round(wall, 1),
        "peak_pss_gib": round(peak["pss"] / 2**30, 2),
        "peak_rss_sum_gib": round(peak["rss"] / 2**30, 2),
        "peak_processes": peak["processes"],
        "success_first10": float(numbers[0]) if numbers else None,
        "success_last10": float(numbers[1]) if len(numbers) > 1 else None,
        "heldout_success_start": float(held_numbers[0]) if held_numbers else None,  # eval at step 0
        "heldout_success_end": float(held_numbers[1]) if len(held_numbers) > 1 else None,  # after the last step
        "machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB",
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    name = args.name or Path(args.config).stem
    out = Path(__file__).parent / "results" / f"job_{name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    sys.exit(code)


if __name__ == "__main__":
    from benchmarks.command_line import run_command

    sys.exit(run_command(main))
