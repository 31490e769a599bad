r"""What held-out evaluation during training costs: the README job with and without its `eval` section.

    python benchmarks/eval_cost.py [--pairs 3] [--config configs/tiny_grpo.yaml]
    python benchmarks/eval_cost.py --pairs 2 --no-warmup --config configs/smollm2_basic_arithmetic.yaml \
        --set train.steps=16 --name eval_cost_smollm2_16steps

Runs the job as a subprocess (`streamrl run`, with each `--set`), alternating with eval (A) and without (B,
`--set eval=null`), `--pairs` times after one warm-up pair (`--no-warmup`: none, for a model already
converted and jobs long enough that a cold cache is noise), so machine drift hits both alike;
the ratio is taken pair by pair. Reports wall time of the whole command, the job's own
elapsed time at its last step (start-up excluded: from the job's first step line), the
evaluator's summed compute (`eval/time_s`), and the held-out success it printed. Writes
benchmarks/results/<--name, default eval_cost>.json after every pair (a stopped run keeps its pairs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.command_line import EXIT_BAD_CONFIG, check_config, refused

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def run_once(config: str, with_eval: bool, overrides: list[str] = ()) -> dict:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "pipelines.cli", "run", config, "--set", f"output_dir={out}"]
        command += [part for override in overrides for part in ("--set", override)]
        if not with_eval:
            command += ["--set", "eval=null"]
        start = time.perf_counter()
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = time.perf_counter() - start
    if proc.returncode == EXIT_BAD_CONFIG:
        raise refused(proc.stderr)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    lines = proc.stdout.splitlines()
    elapsed = [int(m.group(1)) * 60 + int(m.group(2) or 0) if m.group(2) else int(m.group(1))
               for line in lines if (m := re.search(r"elapsed (\d+)m?(\d+)?s", line))]
    evals = [float(m.group(1)) for line in lines if (m := re.search(r"streamrl: eval at step .*, (\d+\.\d+)s$", line))]
    held = next((line for line in lines if "held-out success (eval)" in line), "")
    return {
        "wall_s": round(wall, 2),
        "loop_s": (elapsed[-1] - elapsed[0]) if len(elapsed) > 1 else None,  # first step line -> last
        "evaluations": len(evals), "eval_compute_s": round(sum(evals), 2),
        "success": next((line for line in lines if "success rate first 10" in line), ""),
        "held_out": held,
        # the job's own account: start-up, busy shares, evaluations and the wait for them after the last step
        "wall_line": next((line for line in lines if line.startswith("streamrl: wall time")), ""),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--config", default="configs/tiny_grpo.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="KEY=VALUE for both runs of a pair, as streamrl run")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", help="no warm-up pair")
    parser.add_argument("--name", default="eval_cost", help="the record's file stem in benchmarks/results")
    args = parser.parse_args()
    check_config(args.config, args.overrides)
    load_before = os.getloadavg()
    if args.warmup:  # caches, compiled kernels
        run_once(args.config, True, args.overrides), run_once(args.config, False, args.overrides)
    command = (f"python benchmarks/eval_cost.py --pairs {args.pairs} --config {args.config}"
               + "".join(f" --set {o}" for o in args.overrides) + ("" if args.warmup else " --no-warmup")
               + ("" if args.name == "eval_cost" else f" --name {args.name}"))
    out = HERE / "results" / f"{args.name}.json"
    pairs = []
    for index in range(args.pairs):
        print(f"pair {index + 1}/{args.pairs}: the job with eval, then without", flush=True)
        a, b = run_once(args.config, True, args.overrides), run_once(args.config, False, args.overrides)
        pairs.append({"with_eval": a, "without_eval": b, "wall_ratio": round(a["wall_s"] / b["wall_s"], 3)})
        print(f"pair {index + 1}: with eval {a['wall_s']:.1f}s ({a['evaluations']} evaluations, "
              f"{a['eval_compute_s']:.1f}s of evaluator compute), without {b['wall_s']:.1f}s, "
              f"ratio {pairs[-1]['wall_ratio']:.3f}", flush=True)
        ratios = [p["wall_ratio"] for p in pairs]
        result = {
            "command": command,
            "median_wall_ratio_with_vs_without_eval": statistics.median(ratios),
            "median_wall_s_with_eval": statistics.median(p["with_eval"]["wall_s"] for p in pairs),
            "median_wall_s_without_eval": statistics.median(p["without_eval"]["wall_s"] for p in pairs),
            "pairs": pairs,
            "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "machine": f"{os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d %H:%M"),
        }
        out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "pairs"}, indent=2))


if __name__ == "__main__":
    from benchmarks.command_line import run_command

    sys.exit(run_command(main))
