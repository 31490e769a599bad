"""GPU smoke test: 3 steps of generate + train + weight load on one GPU, in one process, no Ray.

Made for a bare GPU machine that has torch with CUDA and transformers but no Ray, vLLM or MLflow
(DeepSpeed, pydantic and pydantic-core carried as wheels). It runs the project's own trainer
(`operators.workers.train_worker.TrainWorker`: DeepSpeed, NCCL on a world of one, bf16 with fp32 master
weights, per-micro-batch backward, chunked log-probs) and HF engine (`operators.engines.hf`) on a
random Qwen2-shaped ~0.5B model built here (vocabulary 151936, so the chunked log-probs matter),
and prints and writes (JSON) per step: generation tokens/s, train step time, the weight load's
time over the weight plane's wire (pack to host buckets, gloo broadcast to a receiving thread, load),
peak GPU memory, the train step's MFU, and the first update's ratio pi_theta / pi_behave,
which should be ~1 (the engine and the trainer hold the same weights; bf16 rounding aside).

    python benchmarks/gpu_smoke.py --out smoke.json                  # on the GPU machine
    python benchmarks/gpu_smoke.py --tiny --out /tmp/smoke.json      # the same path on a CPU, tiny model

GPU figures come only from a run of this script on a GPU; none is guessed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                 tie_word_embeddings=True, rope_theta=1e6)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
H100_H200_BF16_FLOPS = 989e12  # dense bf16 peak of one H100/H200 SXM, for MFU


class LoopbackPlane:
    """The weight plane's wire in one process: a gloo group of two (this thread sends as the trainer's rank 0,
    a thread receives as an engine would, operators/engines/gloo_transfer.py) over a local TCP store."""

    def __init__(self, timeout_s: float = 120.0):
        import threading
        from datetime import timedelta

        from torch.distributed import TCPStore

        from operators.weight_plane import open_group

        self.timeout_s = timeout_s
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        joined = {}
        peer = threading.Thread(target=lambda: joined.setdefault("group", open_group(
            "127.0.0.1", self.store.port, 1, 2, timeout_s)))
        peer.start()
        self.group = open_group("127.0.0.1", self.store.port, 0, 2, timeout_s)
        peer.join()
        self.peer = joined["group"]

    def send(self, version: int, buckets: list) -> list:
        """Broadcast `buckets` and return what the receiving side got."""
        from concurrent.futures import ThreadPoolExecutor

        from operators.weight_plane import bucket_bytes, encode_layout, layout_of, post_version, receive_version

        with ThreadPoolExecutor(1) as pool:
            got = pool.submit(receive_version, self.peer, self.timeout_s, self.timeout_s)
            header, layout = encode_layout(layout_of(version, buckets, None))
            for work in post_version(self.group, header, layout, [bucket_bytes(b) for b in buckets], self.timeout_s):
                work.wait()
            _, _, received = got.result(self.timeout_s)
        return received


def build(folder: Path, shape: dict) -> Path:
    """A random Qwen2 of `shape` and a word-level tokenizer over its whole vocabulary (t0, t1, ...)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, shape["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>").save_pretrained(folder)
    torch.manual_seed(0)
    config = Qwen2Config(**shape, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def free_port() -> int:
    # pipelines.runtime.trainer_group.free_port does the same, but that module imports Ray, which the GPU machine lacks.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (checks the path on a CPU)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    import numpy as np
    import torch

    from operators.engines.base import SamplingParams
    from operators.engines.hf import HFEngine
    from operators.workers.settings import LrSchedule, TrainerSettings
    from operators.workers.train_worker import TrainWorker
    from operators.weights import WeightSet

    cuda = torch.cuda.is_available()
    shape = TINY if args.tiny else QWEN2_05B
    folder = build(Path(tempfile.mkdtemp(prefix="streamrl-gpu-smoke-")), shape)
    settings = TrainerSettings(
        model_path=str(folder), lr=1e-6, zero_stage=1, dtype="bf16", torch_threads=os.cpu_count() or 1,
        max_new_tokens=args.max_new_tokens, micro_batch_tokens=args.micro_batch_tokens, logits_chunk_tokens=8192,
        lr_schedule=LrSchedule(warmup_steps=0),
    )
    trainer = TrainWorker(0, 1, free_port(), settings, None)  # NCCL on CUDA, gloo on CPU (operators.devices)
    plane = LoopbackPlane()
    engine = HFEngine(str(folder))
    params = sum(p.numel() for p in trainer.engine.module.parameters())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, shape["vocab_size"], 32).tolist() for _ in range(args.prompts)]
    report = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
              "parameters": params, "model": shape, "dtype": "bf16 (fp32 master weights)",
              "backend": torch.distributed.get_backend(), "steps": []}
    print(f"{report['device']}: {params / 1e6:.0f}M parameters, backend {report['backend']}", flush=True)
    for step in range(args.steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        start = time.perf_counter()
        groups = engine.generate(prompts, SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens,
                                                         temperature=1.0, seed=step))
        if cuda:
            torch.cuda.synchronize()
        generate_s = time.perf_counter() - start
        responses = [r for g in groups for r in g.token_ids]
        samples = {
            "prompt_token_ids": [p for p, g in zip(prompts, groups) for _ in g.token_ids],
            "response_token_ids": responses,
            "behavior_logprobs": [lp for g in groups for lp in g.logprobs],
            # a stand-in reward: centred response length within each group (the figures are about speed)
            "advantages": [float(v) for g in groups
                           for v in (np.array([len(r) for r in g.token_ids]) - np.mean([len(r) for r in g.token_ids]))
                           / (np.std([len(r) for r in g.token_ids]) + 1e-6)],
        }
        generated = sum(len(r) for r in responses)
        start = time.perf_counter()
        result = trainer.train_step(samples, generated, len(responses))
        if cuda:
            torch.cuda.synchronize()
        train_s = time.perf_counter() - start
        start = time.perf_counter()
        # the weight plane's wire (operators/weight_plane.py), as far as this machine allows (no Ray, no vLLM):
        # rank 0's buckets in the training dtype (bf16, device to host), broadcast over a gloo group to a
        # receiving thread, then loaded into the HF engine (host to device)
        buckets = list(trainer.weight_buckets())
        packed = time.perf_counter()
        received = plane.send(step + 1, buckets)
        sent = time.perf_counter()
        engine.load_weights(WeightSet(received))
        if cuda:
            torch.cuda.synchronize()
        load_s = time.perf_counter() - start
        plane_s = {"pack_s": packed - start, "broadcast_s": sent - packed, "apply_s": time.perf_counter() - sent}
        trained = generated + 32 * len(responses)
        row = {
            "step": step, "responses": len(responses), "generated_tokens": generated,
            "generate_tokens_per_s": generated / generate_s, "generate_s": generate_s,
            "train_s": train_s, "train_tokens_per_s": trained / train_s,
            "mfu": 6 * params * trained / train_s / H100_H200_BF16_FLOPS if cuda else None,
            "weight_load_s": load_s, **{f"weight_{k}": v for k, v in plane_s.items()},
            "micro_batches": result["micro_batches"],
            "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "policy_loss": result["policy_loss"], "grad_norm": result["grad_norm"],
            "ratio_behavior_min": result.get("ratio_behavior_min"), "ratio_behavior_max": result.get("ratio_behavior_max"),
        }
        report["steps"].append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    first = report["steps"][0]
    print(f"first update's ratio pi_theta/pi_behave: {first['ratio_behavior_min']:.3f}..{first['ratio_behavior_max']:.3f} "
          "(~1: engine and trainer agree)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
