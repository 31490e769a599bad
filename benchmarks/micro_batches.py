"""One trainer step with and without length-sorted micro-batches (`train.micro_batch_tokens`).

    python benchmarks/micro_batches.py [--budgets 0,512,1024,2048,4096] [--threads 1]

One DeepSpeed rank in this process (no Ray), the throughput benchmark's 12.7M Llama, 64
samples with geometric response lengths (mean 15, capped at 128: long-tailed), a prompt
of 7 tokens. Each budget: a warm-up step, then the median of 3 timed steps. Writes
benchmarks/results/micro_batches.json.
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
sys.path[:0] = [str(HERE.parent)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="0,512,1024,2048,4096")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    from operators.workers.train_worker import TrainWorker
    from pipelines.config.load import load_config
    from operators.workers.deepspeed_setup import free_port
    from pipelines.runtime.trainer_settings import trainer_settings
    from throughput import build_bench_model

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
    rows = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        cfg = load_config(None, [f"model.path={path}", f"train.micro_batch_tokens={budget}",
                                 "rollout.max_new_tokens=128", f"train.torch_threads={args.threads}"])
        worker = TrainWorker(0, 1, free_port(), trainer_settings(cfg, path), None)
        worker.train_step(samples, int(lengths.sum()), 64)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            result = worker.train_step(samples, int(lengths.sum()), 64)
            times.append(time.perf_counter() - start)
        rows.append({"micro_batch_tokens": budget, "seconds": statistics.median(times), "micro_batches": result["micro_batches"]})
        print(f"micro_batch_tokens {budget:>5}: {rows[-1]['seconds']:.2f} s per step, {result['micro_batches']} micro-batch(es)",
              flush=True)
    base = rows[0]["seconds"]
    for row in rows[1:]:
        print(f"  {row['micro_batch_tokens']}: {base / row['seconds']:.2f}x faster than one batch")
    (HERE / "results" / "micro_batches.json").write_text(json.dumps({"params": params, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
