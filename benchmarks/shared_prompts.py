"""One policy train step with each group's prompt laid out once (`train.share_prompts`) against sequence
packing (`train.packing`, the default), on the job's own model, prompts and trainer settings.

    python benchmarks/shared_prompts.py [--config configs/smollm2_basic_arithmetic.yaml] [--groups 4]
                                        [--median 60] [--rounds 4] [--out shared_prompts.json]

One DeepSpeed rank in this process (no Ray) per layout, built from the config's trainer settings (the real-model
config: SmolLM2-135M-Instruct, fp32, micro-batches of 2048 tokens, one torch thread). Prompts: the config's
dataset rendered as Generate renders them (chat template, system prompt); `--groups` groups of `rollout.n`
responses each, random tokens of long-tailed lengths (lognormal, median `--median`, capped at
`rollout.max_new_tokens`). A warm-up step of each layout, then `--rounds` rounds of one step packed and one
shared, alternating; the median step time of each, the token slots (rows x width) its forward ran on, and the
first step's loss of each (the same samples from the same weights: equal up to float rounding). Writes
benchmarks/results/<--out>.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]


def workload(cfg, path: str, groups: int, median: float, seed: int = 0) -> dict:
    """The step's samples: the config's first `groups` prompts, each with rollout.n random responses."""
    from operators.prompts import PromptFormat, PromptRenderer
    from pipelines.data.datasets import load_prompts
    from pipelines.data.prompt_checks import load_tokenizer

    frame, _ = load_prompts(cfg.data)
    tokenizer = load_tokenizer(path)
    prompts = PromptRenderer(tokenizer, PromptFormat(**cfg.prompt_options())).encode(list(frame["prompt"][:groups]))
    rng = np.random.default_rng(seed)
    n, cap = cfg.rollout.n, cfg.rollout.max_new_tokens
    lengths = np.clip(rng.lognormal(np.log(median), 0.6, size=groups * n).astype(int), 1, cap)
    special = set(tokenizer.all_special_ids)
    vocab = np.array([t for t in range(len(tokenizer)) if t not in special])
    return {
        "prompt_token_ids": [list(prompts[i // n]) for i in range(groups * n)],
        "response_token_ids": [list(map(int, rng.choice(vocab, size=k))) for k in lengths],
        "behavior_logprobs": [[-2.0] * int(k) for k in lengths],
        "advantages": [float(a) for a in rng.normal(size=groups * n)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(HERE.parent / "configs" / "smollm2_basic_arithmetic.yaml"))
    parser.add_argument("--groups", type=int, default=4, help="groups in the step (default: the config's 4 x n 8)")
    parser.add_argument("--median", type=float, default=60.0, help="median response length, tokens")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default="shared_prompts.json", help="file name under benchmarks/results/")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    from operators.workers.deepspeed_setup import free_port
    from operators.workers.train_worker import TrainWorker
    from pipelines.config.load import load_config
    from pipelines.data.models import resolve_model_path
    from pipelines.runtime.trainer_settings import trainer_settings

    cfg = load_config(args.config, args.overrides)
    path = str(resolve_model_path(cfg.model))
    samples = workload(cfg, path, args.groups, args.median)
    prompt_len = [len(p) for p in samples["prompt_token_ids"]]
    response_len = [len(r) for r in samples["response_token_ids"]]
    tokens = sum(response_len)
    print(f"{args.groups} groups x {cfg.rollout.n}: prompts {min(prompt_len)}-{max(prompt_len)} tokens, responses "
          f"p50 {np.median(response_len):.0f} max {max(response_len)} (sum {tokens}); "
          f"train.micro_batch_tokens {cfg.train.micro_batch_tokens}, {cfg.train.torch_threads} thread(s)", flush=True)
    layouts = {"packed": [], "shared": ["train.share_prompts=true"]}
    workers, slots, losses, times = {}, {}, {}, {name: [] for name in layouts}
    for name, sets in layouts.items():
        worker = TrainWorker(0, 1, free_port(), trainer_settings(load_config(args.config, args.overrides + sets), path))
        seen = []
        worker.engine.module.model.embed_tokens.register_forward_hook(lambda m, a, o, seen=seen: seen.append(a[0].numel()))
        out = worker.train_step(samples, tokens, len(response_len))  # warm-up; the same weights and samples
        workers[name], slots[name], losses[name] = worker, sum(seen), out["policy_loss"]
        print(f"{name}: forward on {slots[name]} token slots in {out['micro_batches']} micro-batch(es); first loss "
              f"{out['policy_loss']:.6f}", flush=True)
    for round_ in range(args.rounds):
        for name, worker in workers.items():
            start = time.perf_counter()
            worker.train_step(samples, tokens, len(response_len))
            times[name].append(time.perf_counter() - start)
        print(f"round {round_ + 1}: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items()), flush=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    ratio = medians["packed"] / medians["shared"]
    print(f"median step: packed {medians['packed']:.3f} s, shared {medians['shared']:.3f} s: {ratio:.2f}x; token slots "
          f"{slots['packed']} -> {slots['shared']} ({slots['packed'] / slots['shared']:.2f}x fewer)")
    record = {
        "command": " ".join(["python", "benchmarks/shared_prompts.py", *sys.argv[1:]]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "load_average": os.getloadavg(), "config": args.config, "overrides": args.overrides,
        "groups": args.groups, "n": cfg.rollout.n, "prompt_tokens": prompt_len[::cfg.rollout.n],
        "response_tokens": response_len, "token_slots": slots, "first_loss": losses,
        "step_seconds": times, "median_step_seconds": medians, "speedup": ratio,
    }
    out = HERE / "results" / args.out
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
