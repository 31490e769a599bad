"""Peak memory of one train step as the step grows, at a fixed micro-batch budget.

A rank's memory should follow its micro-batch, not its step: with a backward per micro-batch and
log-probs computed in recomputed chunks, a step of 512 samples needs what a step of 64 needs. This
runs one `TrainWorker.train_step` (one rank, DeepSpeed, the real trainer) per step size, each in
its own process, on a random ~110M-parameter Llama (12 layers, hidden 768, vocabulary 32000)
built here, with long-tailed response lengths (lognormal, median 24 tokens, capped at 2032; every
step holds one response at the cap, as RL steps with a length limit do). After a small warm-up step
(which allocates the gradients and Adam's moments every step keeps) it records the process's peak
resident memory over the measured step, its growth over the step (peak minus resident before it:
activations, logits, graphs) and the step's wall time.

    python benchmarks/train_memory.py                                  # -> results/train_memory.json, label "after"
    python benchmarks/train_memory.py --code ../old-checkout --label before --sizes 64,128,256
    python benchmarks/train_memory.py --packing false --label padded --sizes 64,256    # padded micro-batches
    python benchmarks/train_memory.py --sizes 64 --repeats 3 --label packed            # median of 3 processes
    python benchmarks/train_memory.py --sizes 64 --label lora --set 'train.lora={}' --set train.lr=1e-4   # LoRA

`--code` runs the trainer of another checkout (e.g. a commit before a change), with the same model,
samples and settings. Runs one size at a time: do not run anything else beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "train_memory.json"
MODEL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=12, max_position_embeddings=2304, tie_word_embeddings=True)
PROMPT_TOKENS, MEDIAN, SIGMA, CAP = 16, 24, 1.2, 2032


def build_model(folder: Path) -> Path:
    """The random Llama, saved once (seeded: the same weights for every run)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**MODEL, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def make_samples(count: int, seed: int = 0, capped: bool = True) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = np.minimum(np.ceil(rng.lognormal(np.log(MEDIAN), SIGMA, size=count)), CAP).astype(int)
    if capped:
        lengths[0] = CAP  # one response at the length cap in every step
    return {
        "prompt_token_ids": [rng.integers(3, MODEL["vocab_size"], PROMPT_TOKENS).tolist() for _ in range(count)],
        "response_token_ids": [rng.integers(3, MODEL["vocab_size"], n).tolist() for n in lengths],
        "behavior_logprobs": [[-10.0] * int(n) for n in lengths],
        "advantages": rng.choice([-1.0, 1.0], size=count).tolist(),
    }


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(model: str, count: int, budget: int, threads: int, packing: str = "true", sets: tuple = ()) -> dict:
    """One train step in this process (run by the parent with the checkout's code on sys.path)."""
    import resource

    from operators.workers.train_worker import TrainWorker
    from pipelines.config.load import load_config
    from operators.workers.deepspeed_setup import free_port
    from pipelines.runtime.trainer_settings import trainer_settings

    samples = make_samples(count)
    settings = [f"train.micro_batch_tokens={budget}", f"train.torch_threads={threads}", "train.lr=1e-5",
                "rollout.max_new_tokens=2032"]
    if packing != "default":  # a checkout from before train.packing existed has no such field
        settings.append(f"train.packing={packing}")
    cfg = load_config(None, [*settings, *sets])
    worker = TrainWorker(0, 1, free_port(), trainer_settings(cfg, model), None)
    # A first small step allocates what every step keeps (gradients, Adam's moments), so the measured
    # step's growth is what depends on the step: activations, logits, the graph.
    warm = make_samples(4, seed=1, capped=False)
    worker.train_step(warm, sum(len(r) for r in warm["response_token_ids"]), 4)
    before = _rss_bytes()
    start = time.perf_counter()
    tokens = sum(len(r) for r in samples["response_token_ids"])
    result = worker.train_step(samples, tokens, count)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"samples": count, "response_tokens": tokens,
            "tokens": tokens + PROMPT_TOKENS * count, "micro_batches": result["micro_batches"],
            "trained_parameters": sum(p.numel() for p in worker.engine.module.parameters() if p.requires_grad),
            "rss_before_step_gib": before / 2**30, "peak_rss_gib": peak / 2**30,
            "step_growth_gib": (peak - before) / 2**30, "step_seconds": seconds,
            "policy_loss": result["policy_loss"], "grad_norm": result["grad_norm"]}


def median_run(repeats: list[dict]) -> dict:
    """One size's record from its repeats: the run with the median peak, and every run's peak and growth."""
    ranked = sorted(repeats, key=lambda run: run["peak_rss_gib"])
    run = dict(ranked[(len(ranked) - 1) // 2])
    if len(repeats) > 1:
        run["peak_rss_gib_runs"] = [round(r["peak_rss_gib"], 3) for r in repeats]
        run["step_growth_gib_runs"] = [round(r["step_growth_gib"], 3) for r in repeats]
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,128,256,512", help="samples per step, comma-separated")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--code", default=str(ROOT), help="the checkout whose trainer runs (default: this one)")
    parser.add_argument("--label", default="after")
    parser.add_argument("--packing", default="true", choices=["true", "false", "default"],
                        help="train.packing of the measured step (default: leave the checkout's default)")
    parser.add_argument("--model-dir", default="/tmp/streamrl-train-memory-llama110m")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable of the measured process, e.g. MALLOC_MMAP_THRESHOLD_=1048576")
    parser.add_argument("--repeats", type=int, default=1,
                        help="processes per size; the record keeps each one's peak and their median (peak RSS "
                             "moved by up to 0.5 GiB between identical runs at 64 samples)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a config override of the measured step, e.g. 'train.lora={}' (repeatable)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, count, budget, threads, packing, *sets = args.child
        print(json.dumps(child(model, int(count), int(budget), int(threads), packing, tuple(sets))))
        return
    model = build_model(Path(args.model_dir))
    code = Path(args.code).resolve()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=code, capture_output=True, text=True).stdout.strip()
    env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{ROOT / 'benchmarks'}", "DS_ACCELERATOR": "cpu",
           "HF_HUB_OFFLINE": "1", **dict(item.split("=", 1) for item in args.env)}
    runs = []
    for count in [int(size) for size in args.sizes.split(",")]:
        print(f"[{args.label}] {count} samples ...", flush=True)
        repeats = []
        for _ in range(args.repeats):
            done = subprocess.run([sys.executable, __file__, "--child", str(model), str(count),
                                   str(args.micro_batch_tokens), str(args.threads), args.packing, *args.set],
                                  cwd=code, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
                repeats = [{"samples": count, "failed": done.stderr.strip().splitlines()[-1][-300:]}]
                break
            repeats.append(json.loads(done.stdout.strip().splitlines()[-1]))
        if "failed" in repeats[0]:
            runs.append(repeats[0])
            continue
        run = median_run(repeats)
        runs.append(run)
        spread = f" (runs: {', '.join(f'{p:.2f}' for p in run['peak_rss_gib_runs'])})" if len(repeats) > 1 else ""
        print(f"  {run['tokens']} tokens, {run['micro_batches']} micro-batches: peak {run['peak_rss_gib']:.2f} GiB "
              f"(+{run['step_growth_gib']:.2f} over the step){spread}, {run['step_seconds']:.1f} s", flush=True)
    record = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    record[args.label] = {
        "command": " ".join(["python", "benchmarks/train_memory.py", *sys.argv[1:]]),
        "code_commit": commit, "model": {**MODEL, "parameters": "~110M"},
        "lengths": {"prompt": PROMPT_TOKENS, "response_lognormal_median": MEDIAN, "sigma": SIGMA, "cap": CAP},
        "micro_batch_tokens": args.micro_batch_tokens, "packing": args.packing, "torch_threads": args.threads,
        "env": args.env, "sets": args.set,
        "date": time.strftime("%Y-%m-%d %H:%M"), "runs": runs,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(record, indent=1) + "\n")
    growth = [r["step_growth_gib"] for r in runs if "step_growth_gib" in r]
    if len(growth) > 1:
        print(f"[{args.label}] step growth {min(growth):.2f}-{max(growth):.2f} GiB over sizes {args.sizes} "
              f"(max/min {max(growth) / max(min(growth), 1e-9):.2f}); record: {RESULTS}")


if __name__ == "__main__":
    from benchmarks.command_line import run_command

    sys.exit(run_command(main))
