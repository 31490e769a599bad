"""Activation memory of one train step's forward and backward on the real SmolLM2-135M, measured on CPU,
against the estimate of pipelines/runtime/memory.py.

Each run is its own process: the real model (pipelines/data/smollm2.py, built once into the model cache
by `streamrl models build smollm2-135m-instruct` or the real-model tests) at the training width, train
mode, optionally with the gradient checkpointing the trainer turns on (operators/workers/deepspeed_setup.py:
`gradient_checkpointing_enable`, non-reentrant), and a micro-batch of 2 rows padded to one length (the
second 1/8 shorter, so a padding mask is passed, as in the trainer's micro-batches), built by the
trainer's `token_batch`. The loss is the trainer's chunked path (TrainWorker._forward with
`logits_chunk_tokens` set: the model's final hidden states, then `chunked_token_logprobs`), with a chunk of
CHUNK positions, below both lengths, so the logits are a cost that does not grow with the length.

Three figures per run, in bytes over what the process held before the forward (weights and gradients
included: the gradients are allocated before, so their first accumulation is not counted):
- `saved`: the tensors autograd saves for backward, summed over distinct storages (parameters left out),
  read with `torch.autograd.graph.saved_tensors_hooks`: what the estimate's activations model;
- `held`: resident memory after the forward (the saved tensors plus the loss's outputs);
- `peak`: the process's peak resident memory over forward and backward (Linux VmHWM, reset before the
  forward by writing 5 to /proc/self/clear_refs): includes the log-prob chunk recomputed in backward, the
  layer recomputed under checkpointing, and the backward's temporaries.
Resident memory follows tensors because each run sets MALLOC_MMAP_THRESHOLD_=65536: glibc then maps
every block over 64 KiB on its own and unmaps it when freed, instead of keeping it for reuse.
(tracemalloc does not see torch's allocations, which do not go through Python's allocator.)

The slope between the two lengths (bytes per token; fixed costs such as the logits chunk, the SDPA mask's
rows and the LM head's gradient drop out), divided by the layers and the hidden size, is the per-token,
per-layer constant in units of h bytes. bf16 is measured on the forward only (`saved`, `held`): its
backward takes minutes on this CPU (bf16 matmuls without AMX).

    python benchmarks/activation_memory.py      # -> results/activation_memory.json (about 3 minutes)
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
RESULTS = ROOT / "benchmarks" / "results" / "activation_memory.json"
ROWS, PROMPT = 2, 16  # the second row is length // 8 tokens shorter
CHUNK = 128  # logits_chunk_tokens (rows x positions) of the measured loss
LENGTHS = (128, 256)  # padded length of each row: 256 and 512 tokens a micro-batch
RUNS = [("fp32", False, True), ("fp32", True, True), ("bf16", False, False)]  # dtype, checkpointing, backward
MIB = 2**20


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(model_path: str, length: int, dtype: str, checkpointing: bool, backward: bool,
            resident: bool = True) -> dict:
    """One forward (and backward) of the trainer's loss in this process; see the module docstring.
    `resident`: also read resident memory (resets this process's VmHWM; meaningful only in a process
    started by `run_child`), else only `saved`."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from operators.algorithms.batching import token_batch
    from operators.algorithms.losses import chunked_token_logprobs
    from operators.algorithms.logprobs import chunkable_head

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
    model = model.to(torch.bfloat16 if dtype == "bf16" else torch.float32).train()
    if checkpointing:  # as operators/workers/deepspeed_setup.build_engine does
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    head = chunkable_head(model)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    responses = [length - PROMPT - length // 8 * row for row in range(ROWS)]
    samples = {"prompt_token_ids": [rng.integers(3, vocab, PROMPT).tolist() for _ in range(ROWS)],
               "response_token_ids": [rng.integers(3, vocab, n).tolist() for n in responses],
               "advantages": [1.0, -1.0][:ROWS]}
    batch = token_batch(samples, model.config.pad_token_id, ("advantages",))
    targets = batch.input_ids[:, 1:]  # [B, L-1]
    for p in model.parameters():
        # Owned copies: from_pretrained may map the weights from the file, paged in only when the forward
        # first reads them (resident memory would count them as activations).
        p.data = p.data.clone()
        p.grad = torch.zeros_like(p)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    before = _status("VmRSS")
    if resident:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # VmHWM := VmRSS
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        # The trainer's chunked path (operators/workers/train_worker.py, TrainWorker._forward).
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention, output_hidden_states=True,
                    logits_to_keep=1)
        hidden = out.hidden_states[-1][:, :-1]  # [B, L-1, H]
        del out
        logprobs, _ = chunked_token_logprobs(hidden, head, targets, 1.0, max(1, CHUNK // ROWS))  # [B, L-1]
        del hidden
        loss = -(logprobs * batch.advantages * batch.mask).sum() / batch.mask.sum()
    held = _status("VmRSS") - before if resident else None
    if backward:
        loss.backward()
    peak = _status("VmHWM") - before if resident and backward else None
    return {"length": length, "rows": ROWS, "tokens": int(batch.input_ids.numel()), "dtype": dtype,
            "gradient_checkpointing": checkpointing, "saved_bytes": sum(saved.values()), "held_bytes": held,
            "peak_bytes": peak}


def run_child(model_path: str, length: int, dtype: str, checkpointing: bool, backward: bool, threads: int = 1) -> dict:
    """`measure` in a fresh process with the allocator setting resident memory needs (module docstring)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "HF_HUB_OFFLINE": "1"}
    args = [model_path, str(length), dtype, str(int(checkpointing)), str(int(backward))]
    done = subprocess.run([sys.executable, __file__, "--child", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"measurement {args} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def estimate(model_path: str, run: dict) -> dict:
    """pipelines/runtime/memory.py's activations, log-prob chunk and LM head gradient for the run, in bytes."""
    from pipelines.runtime.memory import GIB, model_shape, trainer_rank_gib

    parts = trainer_rank_gib(model_shape(model_path), world_size=1, zero_stage=0, bf16=run["dtype"] == "bf16",
                             micro_batch_tokens=run["tokens"], sequence_length=run["length"],
                             logits_chunk_tokens=CHUNK,
                             gradient_checkpointing=run["gradient_checkpointing"])
    return {f"{name}_bytes": parts[name] * GIB for name in ("activations", "logits", "head_gradient")}


def fit(shape: dict, short: dict, long: dict) -> dict:
    """Per-token slopes between two lengths of one setting, and the per-layer constant in units of h bytes."""
    tokens = long["tokens"] - short["tokens"]
    layers, h = shape["num_hidden_layers"], shape["hidden_size"]
    out = {}
    for figure in ("saved", "held", "peak"):
        if long[f"{figure}_bytes"] is None or short[f"{figure}_bytes"] is None:
            continue
        per_token = (long[f"{figure}_bytes"] - short[f"{figure}_bytes"]) / tokens
        out[f"{figure}_bytes_per_token"] = per_token
        out[f"{figure}_h_per_token_layer"] = per_token / layers / h
        out[f"{figure}_fixed_bytes"] = short[f"{figure}_bytes"] - per_token * short["tokens"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="two padded row lengths")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model_path, length, dtype, checkpointing, backward = args.child
        import torch

        torch.set_num_threads(1)
        print(json.dumps(measure(model_path, int(length), dtype, checkpointing == "1", backward == "1")))
        return
    from pipelines.data.smollm2 import cached_smollm2
    from pipelines.runtime.memory import LAYER_ACTIVATION_BYTES, model_shape

    model_path = cached_smollm2()
    if model_path is None:
        sys.exit("SmolLM2-135M is not in the model cache: run `streamrl models build smollm2-135m-instruct` first")
    shape = model_shape(model_path)
    layers, h = shape["num_hidden_layers"], shape["hidden_size"]
    lengths = [int(n) for n in args.lengths.split(",")]
    runs, fits = [], {}
    for dtype, checkpointing, backward in RUNS:
        pair = []
        for length in lengths:
            run = run_child(model_path, length, dtype, checkpointing, backward)
            run["estimate"] = estimate(model_path, run)
            pair.append(run)
            est = run["estimate"]
            total = sum(est.values())
            peak = (f", peak {run['peak_bytes'] / MIB:.1f} (estimate/peak {total / run['peak_bytes']:.2f})"
                    if run["peak_bytes"] is not None else "")
            print(f"{dtype} checkpointing={checkpointing} {run['tokens']} tokens: saved {run['saved_bytes'] / MIB:.1f}, "
                  f"held {run['held_bytes'] / MIB:.1f}{peak} MiB; estimate: activations "
                  f"{est['activations_bytes'] / MIB:.1f} + logits {est['logits_bytes'] / MIB:.1f} + head gradient "
                  f"{est['head_gradient_bytes'] / MIB:.1f} MiB", flush=True)
        runs += pair
        key = f"{dtype}{'_checkpointing' if checkpointing else ''}"
        fits[key] = fit(shape, *pair)
        # memory.py's activations over the same two runs: their slope, in the same units.
        estimated = [run["estimate"]["activations_bytes"] for run in pair]
        counted = (estimated[1] - estimated[0]) / (pair[1]["tokens"] - pair[0]["tokens"]) / layers / h
        fits[key]["estimate_h_per_token_layer"] = counted
        print(f"  {key}: per token and layer {fits[key]['saved_h_per_token_layer']:.1f} h bytes saved, "
              f"{fits[key]['held_h_per_token_layer']:.1f} held"
              + (f", {fits[key]['peak_h_per_token_layer']:.1f} at the peak" if "peak_bytes_per_token" in fits[key] else "")
              + f"; memory.py's activations: {counted:.1f}", flush=True)
    record = {
        "command": " ".join(["python", "benchmarks/activation_memory.py", *sys.argv[1:]]),
        "code_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                      text=True).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M"), "model": "SmolLM2-135M-Instruct (builtin:smollm2-135m-instruct)",
        "shape": shape, "rows": ROWS, "shorter_row_by": "length // 8", "logits_chunk_tokens": CHUNK, "torch_threads": 1,
        "method": "saved: saved_tensors_hooks over distinct storages, parameters left out; held/peak: VmRSS after "
                  "the forward / VmHWM over forward+backward, minus VmRSS before, with MALLOC_MMAP_THRESHOLD_=65536",
        "memory_py_layer_activation_bytes": {str(k): v for k, v in LAYER_ACTIVATION_BYTES.items()},
        "runs": runs, "fits": fits,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(record, indent=1) + "\n")
    print(f"record: {RESULTS}")


if __name__ == "__main__":
    from benchmarks.command_line import run_command

    sys.exit(run_command(main))
