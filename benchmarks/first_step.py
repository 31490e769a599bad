"""Time to the first trained step, A/B: a `streamrl run` command from two checkouts (each with its own
virtualenv), in turn A B A B, each timed from its start to its `step    1/` line and to its exit.

    python benchmarks/first_step.py --a . --b ../main-before --pairs 2 -- \
        run configs/smollm2_basic_arithmetic.yaml --set train.steps=2 --set tracking.enabled=false

Each checkout runs `<checkout>/.venv/bin/streamrl <args> --set output_dir=<scratch>/<a|b>`; every line it prints
is kept, stamped with the seconds since its start, in <scratch>/<a|b>.log. The record
(benchmarks/results/<name>.json) holds every run and the per-pair ratios A/B; quote those (pairing keeps a
ratio meaningful while the machine's speed drifts). Run nothing else beside it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.command_line import run_command
from benchmarks.race import machine

RESULTS = Path(__file__).resolve().parent / "results"


def timed(checkout: Path, args: list[str], log: Path) -> dict:
    """One run: seconds to its first step line and to its exit."""
    start = time.monotonic()
    first = None
    with log.open("a") as out:
        proc = subprocess.Popen([str(checkout / ".venv" / "bin" / "streamrl"), *args], cwd=checkout,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            out.write(f"{time.monotonic() - start:8.1f} {line}")
            if first is None and line.startswith("step    1/"):
                first = time.monotonic() - start
        code = proc.wait()
    return {"first_step_s": None if first is None else round(first, 1),
            "total_s": round(time.monotonic() - start, 1), "exit": code}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, type=Path, help="checkout A (the change)")
    parser.add_argument("--b", required=True, type=Path, help="checkout B (the baseline)")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--scratch", type=Path, default=Path("runs/first_step"))
    parser.add_argument("--name", default="first_step_ab")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="after --: the streamrl arguments")
    options = parser.parse_args(argv)
    args = [a for a in options.args if a != "--"]
    options.scratch.mkdir(parents=True, exist_ok=True)
    runs = []
    for pair in range(options.pairs):
        for label, checkout in (("a", options.a), ("b", options.b)):
            run = timed(checkout.resolve(), [*args, "--set", f"output_dir={(options.scratch / label).resolve()}"],
                        options.scratch / f"{label}.log")
            runs.append({"pair": pair, "checkout": label, **run})
            print(json.dumps(runs[-1]), flush=True)
    ratios = []
    for pair in range(options.pairs):
        a, b = (next(r for r in runs if r["pair"] == pair and r["checkout"] == label) for label in "ab")
        if a["first_step_s"] and b["first_step_s"]:
            ratios.append(round(a["first_step_s"] / b["first_step_s"], 3))
    record = {"command": "python benchmarks/first_step.py " + " ".join(sys.argv[1:] if argv is None else argv),
              **machine(), "runs": runs, "first_step_ratio_a_over_b": ratios}
    out = RESULTS / f"{options.name}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"first step A/B per pair: {ratios}; {out}")


if __name__ == "__main__":
    sys.exit(run_command(main))
