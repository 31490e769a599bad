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

Then two measurements of their own (each section's failure is recorded and the next one still runs):
- padding: the last step's samples trained padded, packed and with each group's prompt laid out once, by
  turns (A B C A B C), seconds and peak memory of each (`train.packing`, `train.share_prompts`);
- weight path at a 7B shape (random Qwen2-7B weights in bf16 on the GPU, no trainer): pack into host
  buckets, broadcast over the loopback gloo group, load into a second copy on the GPU, with pageable
  and with pinned host buffers (`BucketBuffers(pin_memory=...)`), each a cold and a reused round; the
  copy is checked equal to the source;
- the CUDA IPC round trip at the same shape (benchmarks/gpu_ipc.py): the weights reach a second process
  through IPC handles as vLLM's IPC engine ships them, rebuilt equal, and shared (a change seen there).

    python benchmarks/gpu_smoke.py --out smoke.json                  # on the GPU machine
    python benchmarks/gpu_smoke.py --tiny --out /tmp/smoke.json      # the same path on a CPU, tiny model

GPU figures come only from a run of this script on a GPU; none is guessed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gpu_ipc import ipc_round_trip
from benchmarks.gpu_weight_path import LoopbackPlane, synchronize, weight_path


QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                 tie_word_embeddings=True, rope_theta=1e6)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
QWEN2_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=4096,
                tie_word_embeddings=False, rope_theta=1e6)
H100_H200_BF16_FLOPS = 989e12  # dense bf16 peak of one H100/H200 SXM, for MFU


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


def differing(engine_model, trainer) -> int:
    """How many of the engine's tensors, cast to the trainer's dtype (bf16; the HF engine keeps fp32 copies),
    differ from the trainer's: before a load, what the step changed; after it, 0 if the load delivered it.
    The trainer's are walked as it publishes them (under ZeRO-3 each module gathered while compared)."""
    import torch

    theirs = engine_model.state_dict()
    with torch.no_grad():
        return sum(not torch.equal(theirs[name].to(device=tensor.device, dtype=tensor.dtype), tensor)
                   for name, tensor in trainer._named_weights())


def workload(prompts: list, groups: list, rng) -> dict:
    """The step's samples. A random model rarely stops, so every response would run to max_new_tokens: each is
    cut (with its log-probs) to a long-tailed length like the real workload's (log-normal, median 100 tokens,
    as SmolLM2-135M's on basic_arithmetic), so that packing has padding to remove. The advantages are random,
    centred and scaled within each group: a stand-in reward (the figures are about speed), never all zero."""
    import numpy as np

    prompt_ids, response_ids, logprobs, advantages = [], [], [], []
    for prompt, group in zip(prompts, groups):
        scores = rng.standard_normal(len(group.token_ids))
        advantages += ((scores - scores.mean()) / (scores.std() + 1e-6)).tolist()
        for tokens, lps in zip(group.token_ids, group.logprobs):
            keep = int(np.clip(round(rng.lognormal(np.log(100), 0.6)), 8, len(tokens)))
            prompt_ids.append(prompt)
            response_ids.append(list(tokens[:keep]))
            logprobs.append(list(lps[:keep]))
    return {"prompt_token_ids": prompt_ids, "response_token_ids": response_ids,
            "behavior_logprobs": logprobs, "advantages": advantages}


def padding_rounds(trainer, samples: dict, generated: int, rounds: int) -> dict:
    """The same samples trained padded, packed and with shared prompts by turns (A B C A B C): seconds,
    micro-batches, peak memory. Each variant trains the weights the one before it left (the figures are
    about speed and memory)."""
    import dataclasses

    import torch

    packed = trainer.settings
    variants = {"padded": dataclasses.replace(packed, packing=False, share_prompts=False),
                "packed": dataclasses.replace(packed, share_prompts=False),
                "shared": dataclasses.replace(packed, share_prompts=True)}
    out = {name: {"train_s": [], "peak_gpu_memory_gib": [], "micro_batches": None} for name in variants}
    try:
        for _ in range(rounds):
            for name, settings in variants.items():
                trainer.settings = settings
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                synchronize()
                start = time.perf_counter()
                result = trainer.train_step(samples, generated, len(samples["response_token_ids"]))
                synchronize()
                out[name]["train_s"].append(time.perf_counter() - start)
                out[name]["micro_batches"] = result["micro_batches"]
                if torch.cuda.is_available():
                    out[name]["peak_gpu_memory_gib"].append(torch.cuda.max_memory_allocated() / 2**30)
                print(json.dumps({"padding": name, "train_s": round(out[name]["train_s"][-1], 4),
                                  "micro_batches": result["micro_batches"]}), flush=True)
    finally:
        trainer.settings = packed
    out["padded_over_packed"] = min(out["padded"]["train_s"]) / min(out["packed"]["train_s"])
    out["packed_over_shared"] = min(out["packed"]["train_s"]) / min(out["shared"]["train_s"])
    return out


def packing_check(trainer, samples: dict) -> dict:
    """The trainer's log-probs of the same samples packed and padded (no grad), before the first update: how far apart
    they are, beside how far two padded layouts are (micro-batches a quarter as large), and how far each layout
    is from the engine's own log-probs of the same weights (the HF engine computes in fp32, the trainer in its
    training dtype). A packed row whose sequences saw each other would sit further from the engine than the
    padded rows do; rounding in the training dtype keeps both about as far. The shared layout (each group's
    prompt once, a 4D mask: SDPA's masked kernels on CUDA) is held to the same: a response that saw a
    group-mate would sit as far off."""
    import dataclasses

    import numpy as np

    base = trainer.settings

    def logprobs(**changes) -> np.ndarray:
        trainer.settings = dataclasses.replace(base, **changes)
        try:
            return trainer._frozen_logprobs(samples).values  # every response token, in sample order
        finally:
            trainer.settings = base

    packed = logprobs(packing=True, share_prompts=False)
    padded = logprobs(packing=False, share_prompts=False)
    padded_small = logprobs(packing=False, share_prompts=False, micro_batch_tokens=max(base.micro_batch_tokens // 4, 1))
    shared = logprobs(packing=True, share_prompts=True)

    def apart(a: np.ndarray, b: np.ndarray) -> dict:
        gap = np.abs(a - b)
        return {"max": float(gap.max()), "mean": float(gap.mean())}

    engine = np.concatenate([np.asarray(row, dtype=np.float64) for row in samples["behavior_logprobs"]])
    out = {"tokens": int(packed.size), "packed_vs_padded": apart(packed, padded),
           "padded_vs_padded_smaller": apart(padded, padded_small),
           "shared_vs_padded": apart(shared, padded), "packed_vs_engine": apart(packed, engine),
           "padded_vs_engine": apart(padded, engine), "shared_vs_engine": apart(shared, engine)}
    print(json.dumps({"packing_check": out}), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (checks the path on a CPU)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2, 3])
    parser.add_argument("--padding-rounds", type=int, default=2, help="padded/packed rounds on the last step's samples (0: none)")
    parser.add_argument("--plane-shape", choices=["7b", "tiny", "none"], default=None,
                        help="the weight path's model (default: 7b on a GPU, tiny on a CPU)")
    parser.add_argument("--plane-rounds", type=int, default=2, help="weight-path rounds per buffer kind (a cold one, then reused)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    import numpy as np
    import torch

    from operators.engines.base import SamplingParams
    from operators.engines.hf import HFEngine
    from operators.workers.deepspeed_setup import free_port  # Ray-free, as this machine needs
    from operators.workers.settings import LrSchedule, TrainerSettings
    from operators.workers.train_worker import TrainWorker
    from operators.weights.buckets import WeightSet

    cuda = torch.cuda.is_available()
    shape = TINY if args.tiny else QWEN2_05B
    folder = build(Path(tempfile.mkdtemp(prefix="streamrl-gpu-smoke-")), shape)
    settings = TrainerSettings(
        model_path=str(folder), lr=1e-4, zero_stage=args.zero_stage, dtype="bf16", torch_threads=os.cpu_count() or 1,
        max_new_tokens=args.max_new_tokens, micro_batch_tokens=args.micro_batch_tokens, logits_chunk_tokens=8192,
        lr_schedule=LrSchedule(warmup_steps=0),
    )
    # The engine first: under ZeRO-3 the trainer keeps transformers' HfDeepSpeedConfig alive, and while it
    # lives every from_pretrained in the process builds its model partitioned (pipelines/plain_loop.py's order).
    engine = HFEngine(str(folder))
    trainer = TrainWorker(0, 1, free_port(), settings, None)  # NCCL on CUDA, gloo on CPU (operators.common.devices)
    plane = LoopbackPlane()
    params = sum(getattr(p, "ds_numel", p.numel()) for p in trainer.engine.module.parameters())  # ZeRO-3: partitioned
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, shape["vocab_size"], 32).tolist() for _ in range(args.prompts)]
    report = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
              "parameters": params, "model": shape, "dtype": "bf16 (fp32 master weights)", "zero_stage": args.zero_stage,
              "backend": torch.distributed.get_backend(), "steps": []}
    print(f"{report['device']}: {params / 1e6:.0f}M parameters, backend {report['backend']}", flush=True)
    for step in range(args.steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        synchronize()
        start = time.perf_counter()
        groups = engine.generate(prompts, SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens,
                                                         temperature=1.0, seed=step))
        synchronize()
        generate_s = time.perf_counter() - start
        decoded = sum(len(r) for g in groups for r in g.token_ids)
        samples = workload(prompts, groups, rng)
        responses = samples["response_token_ids"]
        generated = sum(len(r) for r in responses)
        if step == 0:  # before any update: the engine sampled these with the weights the trainer holds
            section(report, "packing_check", None, lambda: packing_check(trainer, samples))
        start = time.perf_counter()
        result = trainer.train_step(samples, generated, len(responses))
        synchronize()
        train_s = time.perf_counter() - start
        changed = differing(engine.model, trainer)  # what the step changed (a check, not timed)
        start = time.perf_counter()
        # the weight plane's wire (operators/weights/gloo_plane.py), as far as this machine allows (no Ray, no vLLM):
        # rank 0's buckets in the training dtype (bf16, device to host), broadcast over a gloo group to a
        # receiving thread, then loaded into the HF engine (host to device)
        buckets = list(trainer.weight_buckets())
        packed = time.perf_counter()
        received = plane.send(step + 1, buckets)
        sent = time.perf_counter()
        engine.load_weights(WeightSet(received))
        synchronize()
        load_s = time.perf_counter() - start
        plane_s = {"pack_s": packed - start, "broadcast_s": sent - packed, "apply_s": time.perf_counter() - sent}
        trained = generated + 32 * len(responses)
        row = {
            "step": step, "responses": len(responses), "decoded_tokens": decoded, "trained_response_tokens": generated,
            "generate_tokens_per_s": decoded / generate_s, "generate_s": generate_s,
            "train_s": train_s, "train_tokens_per_s": trained / train_s,
            "mfu": 6 * params * trained / train_s / H100_H200_BF16_FLOPS if cuda else None,
            "weight_load_s": load_s, **{f"weight_{k}": v for k, v in plane_s.items()},
            "micro_batches": result["micro_batches"],
            "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "policy_loss": result["policy_loss"], "grad_norm": result["grad_norm"],
            "ratio_behavior_min": result.get("ratio_behavior_min"), "ratio_behavior_max": result.get("ratio_behavior_max"),
            "tensors_changed_by_step": changed, "tensors_differing_after_load": differing(engine.model, trainer),
        }
        report["steps"].append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    first = report["steps"][0]
    print(f"first update's ratio pi_theta/pi_behave: {first['ratio_behavior_min']:.3f}..{first['ratio_behavior_max']:.3f} "
          "(~1: engine and trainer agree)", flush=True)
    write(report, args.out)
    del engine
    if args.padding_rounds:
        section(report, "padding", args.out, lambda: padding_rounds(trainer, samples, generated, args.padding_rounds))
    del trainer
    plane_shape = args.plane_shape or ("7b" if cuda else "tiny")
    if plane_shape != "none":
        section(report, "weight_path", args.out,
                lambda: weight_path(QWEN2_7B if plane_shape == "7b" else TINY, plane, args.plane_rounds))
        section(report, "ipc_round_trip", args.out,
                lambda: ipc_round_trip(QWEN2_7B if plane_shape == "7b" else TINY, args.plane_rounds))


def write(report: dict, out: str | None) -> None:
    if out:
        Path(out).write_text(json.dumps(report, indent=1) + "\n")


def section(report: dict, name: str, out: str | None, run) -> None:
    """Run one measurement; its figures, or its error and traceback, go into the report, which is written."""
    import traceback

    try:
        report[name] = run()
    except Exception as error:  # noqa: BLE001 - recorded, so that the sections after this one still run
        report[name] = {"error": repr(error), "traceback": traceback.format_exc()}
        print(f"{name} failed: {error!r}", flush=True)
    write(report, out)


if __name__ == "__main__":
    from benchmarks.command_line import run_command

    sys.exit(run_command(main))
