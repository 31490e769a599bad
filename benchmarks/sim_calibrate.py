"""The simulation's calibration on this machine (`python benchmarks/simulate_cluster.py --calibrate`):
decode tick cost against batch size and training cost per token for a benchmark Llama on this CPU,
recorded in results/sim_calibration.json.
"""

from __future__ import annotations

import json
import os
import platform
import time
import uuid
from pathlib import Path

import numpy as np


def calibrate(model_size: str, out: Path) -> dict:
    """Measure decode tick cost against batch size (HF forward with KV cache) and training
    cost per token (the real DeepSpeed TrainWorker) for a benchmark Llama on this CPU."""
    import torch
    from benchmarks.generate_throughput import build_model

    torch.set_num_threads(1)
    path, params = build_model(model_size, Path("/tmp/streamrl-bench-models"))
    decode = _measure_decode(path)
    train = _measure_train(path)
    batches = np.array([b for b, _ in decode], dtype=float)
    ticks = np.array([t for _, t in decode])
    b, a = np.polyfit(batches, ticks, 1)
    record = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}",
        "date": time.strftime("%Y-%m-%d %H:%M"), "model": model_size, "parameters": params, "torch_threads": 1,
        "decode_tick_seconds_by_batch": {int(k): round(v, 5) for k, v in decode},
        "decode_step_s": round(float(a), 5), "decode_per_seq_s": round(float(b), 6),
        "decode_fit_max_rel_error": round(float(np.max(np.abs(a + b * batches - ticks) / ticks)), 3),
        "train_seconds_per_token": train["seconds_per_token"], "train_runs": train["runs"],
        "ratio_train_token_over_decode_token_at_batch_64": round(
            train["seconds_per_token"] / ((a + b * 64) / 64), 2),
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    return record


def _measure_decode(path: Path, new_tokens: int = 24) -> list[tuple[int, float]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    results = []
    with torch.no_grad():
        for batch in (1, 4, 16, 32, 64):
            ids = torch.randint(3, vocab, (batch, 16))
            seconds = []
            for _ in range(2):
                out = model(ids, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
                start = time.perf_counter()
                for _ in range(new_tokens):
                    out = model(token, past_key_values=past, use_cache=True)
                    past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
                seconds.append((time.perf_counter() - start) / new_tokens)
            results.append((batch, float(min(seconds))))
            print(f"calibrate: decode batch {batch:>3}: {min(seconds) * 1e3:.2f} ms/tick", flush=True)
    return results


def _measure_train(path: Path) -> dict:
    import ray

    from operators.workers.settings import TrainerSettings
    from operators.workers.train_worker import TrainWorker
    from pipelines.runtime.session import init_ray
    from pipelines.runtime.policy_store import create_policy_store
    from operators.workers.deepspeed_setup import free_port

    init_ray(num_cpus=2)
    try:
        store_name = f"calibrate-{uuid.uuid4().hex[:6]}"
        store = create_policy_store(store_name)
        settings = TrainerSettings(model_path=str(path), max_new_tokens=128)
        worker = ray.remote(TrainWorker).options(num_cpus=1).remote(0, 1, free_port(), settings, store)
        ray.get(worker.ready.remote())
        rng = np.random.default_rng(0)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        runs = []
        for batch, length in ((16, 64), (16, 128), (32, 128)):
            samples = {
                "prompt_token_ids": [[1, 5, 6, 7]] * batch,
                "response_token_ids": rng.integers(3, vocab, (batch, length)).tolist(),
                "behavior_logprobs": [[-1.0] * length] * batch,
                "advantages": rng.normal(size=batch).tolist(),
            }
            best = min(ray.get(worker.train_step.remote(samples, batch * length, batch))["train_seconds"]
                       for _ in range(2))
            tokens = batch * (length + 4)
            runs.append({"batch": batch, "response_tokens": length, "seconds": round(best, 3),
                         "seconds_per_token": best / tokens})
            print(f"calibrate: train {batch} x {length}: {best:.2f} s, {best / tokens * 1e3:.3f} ms/token", flush=True)
        ray.kill(worker)
        store.kill()
    finally:
        ray.shutdown()
    return {"seconds_per_token": round(float(np.median([r["seconds_per_token"] for r in runs])), 6), "runs": runs}
