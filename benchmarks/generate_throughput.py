"""Generation throughput of the Hugging Face and vLLM engines inside the `Generate` operator,
and the latency of an in-place weight update, against model size.

    python benchmarks/generate_throughput.py [--sizes small,large] [--engines hf,vllm] [--vllm-dtypes float32,bfloat16]

Models are untrained Llamas built locally with the character tokenizer (no downloads).
An untrained model ends a response when it happens to sample EOS, so response lengths
are geometric: a long tail up to `max_new_tokens`, as in reasoning RL. Both engines get
the same prompts and sampling settings (n, temperature 1, top_p 1, max_new_tokens).
Prints a table and writes benchmarks/results/generate_throughput.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

SIZES = {
    # name: (hidden, layers, heads, intermediate) -> parameters printed at run time
    "small": (256, 4, 4, 688),
    "medium": (512, 4, 8, 1376),
    "large": (768, 6, 12, 2048),
}
RESULTS = Path(__file__).parent / "results"


def build_model(name: str, root: Path) -> tuple[Path, int]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipelines.data.tiny import build_char_tokenizer

    hidden, layers, heads, intermediate = SIZES[name]
    path = root / f"llama-{name}"
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, intermediate_size=intermediate, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    if not (path / "config.json").exists():
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path, sum(p.numel() for p in model.parameters())


def prompts(count: int) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    rows = [f"{a}+{b}=" for a, b in rng.integers(0, 100, size=(count, 2))]
    return pd.DataFrame({"prompt": rows, "group_uid": [f"g{i}" for i in range(count)]})


def measure(engine: str, model_path: Path, groups: list[int], n: int, max_new_tokens: int, repeats: int,
            dtype: str = "float32") -> dict:
    from operators.stages.generate import Generate

    options = {"torch_threads": 2}
    if engine == "vllm":
        options = {"gpu_memory_utilization": 0.2, "max_model_len": 512, "dtype": dtype}
    start = time.perf_counter()
    op = Generate(str(model_path), engine=engine, n=n, max_new_tokens=max_new_tokens, engine_options=options)
    result = {"engine": engine, "dtype": dtype if engine == "vllm" else "float32", "start_seconds": round(time.perf_counter() - start, 1), "batches": {}}
    next(op(prompts(2)))  # warm-up call
    for size in groups:
        rates, lengths = [], []
        for repeat in range(repeats):
            batch = prompts(size).assign(group_uid=lambda d, r=repeat: d["group_uid"] + f"-{r}")
            t0 = time.perf_counter()
            out = next(op(batch))
            seconds = time.perf_counter() - t0
            tokens = [length for row in out["response_lengths"] for length in row]
            rates.append(sum(tokens) / seconds)
            lengths += tokens
        result["batches"][size] = {
            "tokens_per_s": round(float(np.median(rates)), 1),
            "response_length_mean": round(float(np.mean(lengths)), 1),
            "response_length_p50": int(np.percentile(lengths, 50)),
            "response_length_p90": int(np.percentile(lengths, 90)),
            "response_length_max": int(max(lengths)),
        }
    weights = {k: v.detach().numpy().copy() for k, v in _state_dict(model_path).items()}
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        op.engine.load_weights(weights)
        times.append(time.perf_counter() - t0)
    result["weight_update_seconds"] = round(float(np.median(times)), 4)
    del op
    gc.collect()
    return result


def _state_dict(model_path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True).state_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="small,large", help=f"model sizes from {list(SIZES)}")
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--groups", default="16,64", help="prompt groups per Generate call")
    parser.add_argument("--n", type=int, default=4, help="responses per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--models", default="/tmp/streamrl-bench-models")
    parser.add_argument("--vllm-dtypes", default="float32", help="vLLM compute dtypes to time (the HF engine: float32)")
    parser.add_argument("--out", default="generate_throughput.json", help="file name under benchmarks/results/")
    args = parser.parse_args()
    groups = [int(g) for g in args.groups.split(",")]
    records = []
    for size in args.sizes.split(","):
        path, params = build_model(size, Path(args.models))
        for engine, dtype in [(e, d) for e in args.engines.split(",")
                              for d in (args.vllm_dtypes.split(",") if e == "vllm" else ["float32"])]:
            record = measure(engine, path, groups, args.n, args.max_new_tokens, args.repeats, dtype)
            record.update(model=size, parameters=params)
            records.append(record)
            print(json.dumps(record), flush=True)
    print(f"\n{'model':<8}{'params':>8} {'engine':<6}{'dtype':>9}{'groups':>7}{'tok/s':>10}{'len mean/p90/max':>20}{'update s':>10}")
    for r in records:
        for size, b in r["batches"].items():
            print(f"{r['model']:<8}{r['parameters'] / 1e6:>7.1f}M {r['engine']:<6}{r['dtype']:>9}{size:>7}{b['tokens_per_s']:>10.0f}"
                  f"{b['response_length_mean']:>10.1f}/{b['response_length_p90']}/{b['response_length_max']:<5}"
                  f"{r['weight_update_seconds']:>10.4f}")
    by_key = {(r["model"], r["engine"]): r for r in records if r["dtype"] == "float32"}
    for model in {r["model"] for r in records}:
        rates = {r["dtype"]: r["batches"] for r in records if r["model"] == model and r["engine"] == "vllm"}
        if "float32" in rates and "bfloat16" in rates:
            print(f"{model} vLLM bfloat16 / float32 tokens/s (same run):",
                  {size: round(rates["bfloat16"][size]["tokens_per_s"] / rates["float32"][size]["tokens_per_s"], 2)
                   for size in groups})
    ratios = {
        f"{model} x{size}": round(by_key[(model, "vllm")]["batches"][size]["tokens_per_s"]
                                  / by_key[(model, "hf")]["batches"][size]["tokens_per_s"], 2)
        for (model, engine) in by_key if engine == "hf" and (model, "vllm") in by_key for size in groups
    }
    if ratios:
        print("vLLM / HF tokens/s (same run):", ratios)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / args.out
    out.write_text(json.dumps({
        "command": "python benchmarks/generate_throughput.py " + " ".join(
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "records": records, "vllm_over_hf": ratios,
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":  # vLLM starts its engine with spawn
    from benchmarks.command_line import run_command

    sys.exit(run_command(main))
