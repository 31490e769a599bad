"""The trainer's weights as the weight source vLLM's trainer-side engines take (operators/weights/source.py):
`metadata()`, worked out with nothing gathered, equals what the weight walk yields (name, dtype, full shape,
in order), as vLLM's dense NCCL engine requires (it sizes the receivers from the first and sends the second).
One DeepSpeed rank in a process of its own, with every parameter partitioned under ZeRO-3 (threshold 0: each
parameter's own shape is an empty placeholder, its full one `ds_shape`), with and without LoRA, and ZeRO-0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import functools, json, sys
import deepspeed, torch
from operators.weights.buckets import named_weights
from operators.weights.source import TrainerWeights, full_shape, vllm_weight_source
from operators.workers.deepspeed_setup import free_port
from operators.workers.lora import LoraSettings
from operators.workers.settings import LrSchedule, TrainerSettings
from operators.workers.train_worker import TrainWorker

model_path, zero_stage, lora = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "lora"
settings = TrainerSettings(model_path=model_path, lr=1e-3, zero_stage=zero_stage, dtype="fp32", torch_threads=1,
                           max_new_tokens=8, lr_schedule=LrSchedule(warmup_steps=0), zero3_persistence_threshold=0,
                           lora=LoraSettings(r=4, alpha=8) if lora else None)
trainer = TrainWorker(0, 1, free_port(), settings, None)
module = trainer.engine.module
gathered = deepspeed.zero.GatheredParameters if zero_stage == 3 else None
if lora:
    from operators.weights.lora_merge import merged_weights
    walk = functools.partial(merged_weights, module, gathered)
else:
    walk = functools.partial(named_weights, module, gathered)
weights = TrainerWeights(module, walk, lora=lora)
described = [[name, str(dtype), list(shape)] for name, dtype, shape in weights.metadata()]
for round_ in range(2):  # a fresh pass each time
    walked = [[name, str(tensor.dtype), list(tensor.shape)] for name, tensor in weights]
    assert walked == described, (round_, walked, described)
local = [list(p.shape) for p in module.parameters()]
try:
    source = vllm_weight_source(weights)
    vllm_meta = [[m.name, str(m.dtype), list(m.shape)] for m in source.metadata()]
    vllm_walk = [[n, str(t.dtype), list(t.shape)] for n, t in source]
except ImportError:
    vllm_meta = vllm_walk = None
print(json.dumps({"described": described, "local_shapes": local, "vllm_meta": vllm_meta, "vllm_walk": vllm_walk}))
'''


@pytest.mark.parametrize("zero_stage,lora", [
    (3, False), (3, True), pytest.param(0, False, marks=pytest.mark.extended),  # ZeRO-0: nothing partitioned
], ids=["zero3", "zero3-lora", "zero0"])
def test_metadata_equals_what_the_walk_yields_with_nothing_gathered(tiny_model_path, zero_stage, lora):
    if lora:
        pytest.importorskip("peft", reason="peft is not installed (pip install 'streamrl[lora]')")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_path), str(zero_stage),
                           "lora" if lora else "full"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    names = [name for name, _, _ in record["described"]]
    assert names and len(names) == len(set(names)) and all(dtype == "torch.float32" for _, dtype, _ in record["described"])
    assert not any("lora_" in name or "base_layer" in name for name in names)  # the base model's names only
    if zero_stage == 3:  # the metadata did not read the local shapes: they are empty placeholders
        assert all(shape == [0] for shape in record["local_shapes"])
    assert all(all(size > 0 for size in shape) for _, _, shape in record["described"])
    if record["vllm_meta"] is not None:  # vLLM's own class over the same source
        assert record["vllm_meta"] == record["described"] == record["vllm_walk"]
