"""One policy train step with each group's prompt laid out once (`train.share_prompts`) against sequence
packing (`train.packing`, the default), on the job's own model, prompts and trainer settings.

    python benchmarks/shared_prompts.py [--config configs/smollm2_basic_arithmetic.yaml] [--groups 4]
                                        [--median 60] [--rounds 4] [--stage train|reference]
                                        [--out shared_prompts.json]

`--stage reference`: the reference model's forward (RefLogprob, as the job's ref_logprob stage builds it: the
config's `reference` section or its defaults) instead of the train step, and the largest difference of the two
layouts' log-probs instead of the loss.

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


def workload(cfg, path: str, groups: int, median: float, seed: int = 0) -> dict:
    """The step's samples: the config's first `groups` prompts, each with rollout.n random responses."""
    from operators.common.prompts import PromptFormat, PromptRenderer
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
    parser.add_argument("--stage", choices=("train", "reference"), default="train",
                        help="the policy's train step, or the reference model's forward (RefLogprob)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default="shared_prompts.json", help="file name under benchmarks/results/")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    from operators.stages.ref_logprob import RefLogprob
    from operators.workers.deepspeed_setup import free_port
    from operators.workers.train_worker import TrainWorker
    from pipelines.config.load import load_config
    from pipelines.config.model import ReferenceConfig
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
    layouts = {"packed": ["train.share_prompts=false"], "shared": ["train.share_prompts=true"]}
    runners, slots, first, times = {}, {}, {}, {name: [] for name in layouts}
    for name, sets in layouts.items():
        layout_cfg = load_config(args.config, args.overrides + sets)
        if args.stage == "train":
            worker = TrainWorker(0, 1, free_port(), trainer_settings(layout_cfg, path))
            embed = worker.engine.module.model.embed_tokens

            def run(worker=worker):
                return worker.train_step(samples, tokens, len(response_len))["policy_loss"]
        else:  # the reference model's forward, as the job's ref_logprob stage builds it (pipelines/stages.py)
            ref = RefLogprob(path, temperature=cfg.rollout.temperature, micro_batch_tokens=(cfg.reference or ReferenceConfig()).micro_batch_tokens,
                             torch_threads=cfg.train.torch_threads, logits_chunk_tokens=cfg.train.logits_chunk_tokens,
                             share_prompts=layout_cfg.train.share_prompts)
            embed = ref.model.model.embed_tokens
            sequences = list(zip(samples["prompt_token_ids"], samples["response_token_ids"]))

            def run(ref=ref, sequences=sequences):
                return np.concatenate(ref.score(sequences))
        seen = []
        embed.register_forward_hook(lambda m, a, o, seen=seen: seen.append(a[0].numel()))
        first[name] = run()  # warm-up; the same weights and samples
        runners[name], slots[name] = run, sum(seen)
        print(f"{name}: forward on {slots[name]} token slots", flush=True)
    if args.stage == "train":
        agreement = {"first_loss": first}
        print(f"first loss: packed {first['packed']:.6f}, shared {first['shared']:.6f}")
    else:
        agreement = {"max_abs_logprob_difference": float(np.abs(first["packed"] - first["shared"]).max())}
        print(f"log-probs of {len(first['packed'])} tokens, largest difference {agreement['max_abs_logprob_difference']:.2e}")
    for round_ in range(args.rounds):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
        print(f"round {round_ + 1}: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items()), flush=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    ratio = medians["packed"] / medians["shared"]
    print(f"median {args.stage} step: packed {medians['packed']:.3f} s, shared {medians['shared']:.3f} s: {ratio:.2f}x; token slots "
          f"{slots['packed']} -> {slots['shared']} ({slots['packed'] / slots['shared']:.2f}x fewer)")
    record = {
        "command": " ".join(["python", "benchmarks/shared_prompts.py", *sys.argv[1:]]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "load_average": os.getloadavg(), "config": args.config, "overrides": args.overrides,
        "groups": args.groups, "n": cfg.rollout.n, "prompt_tokens": prompt_len[::cfg.rollout.n],
        "stage": args.stage, "response_tokens": response_len, "token_slots": slots, **agreement,
        "step_seconds": times, "median_step_seconds": medians, "speedup": ratio,
    }
    out = HERE / "results" / args.out
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    from benchmarks.command_line import run_command

    sys.exit(run_command(main))
