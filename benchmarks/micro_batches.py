"""One trainer step at several micro-batch budgets (`train.micro_batch_tokens`), padded micro-batches
(length-sorted, each padded to its longest) against packed ones (`train.packing`, the default).

    python benchmarks/micro_batches.py [--budgets 0,512,1024,2048,4096] [--threads 1] [--packing false,true]
                                       [--dtypes fp32,bf16]

One DeepSpeed rank in this process (no Ray), the throughput benchmark's 12.7M Llama, 64
samples with geometric response lengths (mean 15, capped at 128: long-tailed), a prompt
of 7 tokens. Each budget and layout: a warm-up step, then the median of 3 timed steps, and the token
slots (rows x width) the model ran on. `--dtypes fp32,bf16` also times bf16 (DeepSpeed bf16 under ZeRO-1:
a bf16 module, fp32 master weights; on CPUs with AVX512-BF16 the matmuls run in bf16). Writes
benchmarks/results/micro_batches.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="0,512,1024,2048,4096")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--packing", default="false,true", help="layouts to time, in order")
    parser.add_argument("--dtypes", default="fp32", help="training dtypes to time (bf16 runs under ZeRO-1)")
    parser.add_argument("--out", default="micro_batches.json", help="file name under benchmarks/results/")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    from operators.workers.train_worker import TrainWorker
    from pipelines.config.load import load_config
    from operators.workers.deepspeed_setup import free_port
    from pipelines.runtime.trainer_settings import trainer_settings
    from benchmarks.throughput import build_bench_model

    path, params = build_bench_model("medium")
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.geometric(1 / 15, size=64), 128)
    samples = {
        "prompt_token_ids": [[1, 5, 6, 7, 8, 9, 10]] * 64,
        "response_token_ids": [list(map(int, rng.integers(4, 19, size=n))) for n in lengths],
        "behavior_logprobs": [[-2.0] * int(n) for n in lengths],
        "advantages": [float(a) for a in rng.normal(size=64)],
    }
    print(f"{params / 1e6:.1f}M parameters; 64 samples, response lengths p50 {np.median(lengths):.0f} "
          f"p90 {np.percentile(lengths, 90):.0f} max {lengths.max()} (sum {lengths.sum()}); {args.threads} thread(s)")
    tokens = int(lengths.sum()) + 7 * 64
    rows = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        for packing, dtype in [(p, d) for d in args.dtypes.split(",") for p in args.packing.split(",")]:
            cfg = load_config(None, [f"model.path={path}", f"train.micro_batch_tokens={budget}", f"train.packing={packing}",
                                     "rollout.max_new_tokens=128", f"train.torch_threads={args.threads}",
                                     f"train.dtype={dtype}", f"train.zero_stage={1 if dtype == 'bf16' else 0}"])
            worker = TrainWorker(0, 1, free_port(), trainer_settings(cfg, path), None)
            slots = []
            worker.engine.module.model.embed_tokens.register_forward_hook(lambda m, a, o: slots.append(a[0].numel()))
            worker.train_step(samples, int(lengths.sum()), 64)
            times, step_slots = [], sum(slots)
            for _ in range(3):
                start = time.perf_counter()
                result = worker.train_step(samples, int(lengths.sum()), 64)
                times.append(time.perf_counter() - start)
            rows.append({"micro_batch_tokens": budget, "packing": packing == "true", "dtype": dtype,
                         "seconds": statistics.median(times),
                         "micro_batches": result["micro_batches"], "token_slots": step_slots, "tokens": tokens})
            print(f"micro_batch_tokens {budget:>5} {'packed' if packing == 'true' else 'padded'} {dtype}: "
                  f"{rows[-1]['seconds']:.2f} s per step, {result['micro_batches']} micro-batch(es), "
                  f"{step_slots} token slots for {tokens} tokens", flush=True)
    def name(row: dict) -> str:
        return f"{row['micro_batch_tokens']} {'packed' if row['packing'] else 'padded'} {row['dtype']}"

    base = rows[0]
    for row in rows[1:]:
        print(f"  {name(row)}: {base['seconds'] / row['seconds']:.2f}x faster than {name(base)}")
    for budget in sorted({row["micro_batch_tokens"] for row in rows}):
        same = {(row["packing"], row["dtype"]): row["seconds"] for row in rows if row["micro_batch_tokens"] == budget}
        for dtype in args.dtypes.split(","):
            if (False, dtype) in same and (True, dtype) in same:
                print(f"  {budget} {dtype}: packed {same[(False, dtype)] / same[(True, dtype)]:.2f}x faster than padded")
        if (True, "fp32") in same and (True, "bf16") in same:
            print(f"  {budget} packed: bf16 {same[(True, 'fp32')] / same[(True, 'bf16')]:.2f}x faster than fp32")
    (HERE / "results" / args.out).write_text(json.dumps(
        {"params": params, "command": "python benchmarks/micro_batches.py " + " ".join(sys.argv[1:]),
         "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))

if __name__ == "__main__":
    from benchmarks.command_line import run_command

    sys.exit(run_command(main))
