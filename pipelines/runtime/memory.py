"""An estimate of a trainer rank's GPU memory, so that a config that cannot fit is refused before
anything starts (config validation, when `ray.cluster` declares `gpu_memory_gb`).

It is an estimate, written to catch configs that are off by a large factor (a whole rank's step in
one micro-batch, fp32 logits over a 150k vocabulary), not to predict the allocator's peak:

- weights, gradients and optimizer state from the parameter count, by dtype and ZeRO stage
  (bf16: 2-byte weights and gradients, fp32 master weights and Adam moments, 12 bytes; fp32: 4 + 4 + 8;
  ZeRO 1 partitions the optimizer state, 2 also the gradients, 3 also the weights), and the optimizer step's
  fp32 temporary (4 bytes a trained weight, partitioned as the optimizer state);
- activations of the largest micro-batch: what a Hugging Face Llama/Qwen2 layer keeps for backward
  (LAYER_ACTIVATION_BYTES, counted and measured by benchmarks/activation_memory.py), for every layer; with
  gradient checkpointing, each layer's input (hidden x the training width) plus one layer's activations,
  rebuilt while its backward runs;
- the log-prob chunk: `logits_chunk_tokens` positions x vocabulary x 4 bytes x 4 (fp32 logits, their
  log-softmax, the entropy's product, the gradient);
- the LM head's weight gradient in backward, twice (vocabulary x hidden x width each): autograd sums the
  chunks' gradients in one buffer before they reach the parameter (with tied embeddings, only once the
  embedding's own has joined them, at the end of backward) while the next chunk's is computed.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

from pipelines.runtime.rollout_settings import weight_plane

GIB = 2**30
# Bytes a Hugging Face Llama/Qwen2 decoder layer keeps for backward per token, by training width (bytes a
# value: 2 for bf16, 4 for fp32), as (bytes per hidden unit, bytes per MLP unit). Counted from the tensors
# autograd saves (SDPA attention, padded micro-batches): each of the two RMSNorms keeps its input upcast
# to fp32 (4 h) and its normalised and scaled outputs (2 x width x h); attention keeps q, k and v (k and v
# repeated to every head, as HF does when a padding mask is passed) and its output (4 x width x h); the
# gated MLP keeps gate, SiLU(gate), up and their product (4 x width x inter). Each layer's SDPA also keeps
# the padding mask it was passed, as a [rows, 1, L, L] float tensor of its own: L x width bytes a token,
# L the padded sequence length (layer_activation_bytes adds it). 16-bit: 24 h + 8 inter + 2 L, i.e., the
# mask aside, 45 h for SmolLM2-135M (inter 2.7 h) and 67-71 h for Qwen2.5-0.5B/1.5B (inter 5.4-5.8 h), not
# the 34 h Korthikanti et al. give for Megatron's fused kernels; fp32 is 1.8x that, not 2x (the norms'
# fp32 copies). benchmarks/activation_memory.py measured the real SmolLM2-135M on CPU at 2 x 128 and
# 2 x 256 tokens (results/activation_memory.json): per-token slopes of 47.0 h per layer in bf16 and
# 85.8 h in fp32, against 46.7 h and 85.3 h counted here (the rest lies outside the layers), and a
# forward-and-backward peak 3-6% above this estimate's activations, log-prob chunk and head gradient, with
# and without checkpointing; tests/integration/test_activation_memory.py checks it again. On GPUs SDPA's
# flash and memory-efficient kernels keep the same q, k, v, output and log-sum-exp (not measured there).
LAYER_ACTIVATION_BYTES = {2: (24, 8), 4: (40, 16)}
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size", "num_attention_heads")


def model_shape(model_path: str) -> dict | None:
    """The dimensions the estimate needs from a model folder's config.json; None when it lacks them or cannot be
    read (pipelines/data/models.py names a broken config.json to the user)."""
    config_file = Path(model_path) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    return config_shape(config) if isinstance(config, dict) else None


def config_shape(config: dict) -> dict | None:
    """The dimensions the estimate needs from a model's config (config.json's mapping); None when it lacks them."""
    if any(not isinstance(config.get(key), int) for key in SHAPE_KEYS):
        return None
    return {key: config[key] for key in SHAPE_KEYS} | {
        "num_key_value_heads": int(config.get("num_key_value_heads") or config["num_attention_heads"]),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
    }


def parameter_count(shape: dict) -> int:
    """Parameters of a Llama-shaped decoder (grouped-query attention, gated MLP, RMS norms)."""
    h, layers, inter, vocab = (shape[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"))
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 2 * kv + h + 3 * h * inter + 2 * h  # q, o, k, v (+ biases), mlp, norms
    embeddings = vocab * h * (1 if shape["tie_word_embeddings"] else 2)
    return layers * per_layer + embeddings + h


def lora_parameter_count(shape: dict, r: int, targets) -> int:
    """LoRA weights of rank `r` on a Llama-shaped decoder: r x (in + out) for each targeted projection of each
    layer (`targets`: "all-linear", or names; a name that is not one of the seven projections counted h x h)."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    sizes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
             "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    chosen = list(sizes.values()) if isinstance(targets, str) else [sizes.get(name, (h, h)) for name in targets]
    return shape["num_hidden_layers"] * r * sum(inputs + outputs for inputs, outputs in chosen)


def layer_activation_bytes(shape: dict, width: int, sequence_length: int) -> int:
    """Bytes one decoder layer keeps for backward per token at a training width of `width` bytes, in rows
    padded to `sequence_length` tokens (LAYER_ACTIVATION_BYTES, and a row of the padding mask)."""
    per_hidden, per_inter = LAYER_ACTIVATION_BYTES[width]
    return per_hidden * shape["hidden_size"] + per_inter * shape["intermediate_size"] + width * sequence_length


def trainer_rank_gib(shape: dict, *, world_size: int, zero_stage: int, bf16: bool, micro_batch_tokens: int,
                     sequence_length: int, logits_chunk_tokens: int, gradient_checkpointing: bool,
                     trained: int | None = None) -> dict[str, float]:
    """GiB per rank by component (see the module docstring); `micro_batch_tokens`: the largest
    micro-batch's padded tokens, in rows of `sequence_length`. `trained`: the weights that train when not all
    do (LoRA adapters: only they have gradients and optimizer state, and the output head is frozen)."""
    params = parameter_count(shape)
    learned = params if trained is None else trained
    h, layers, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    width = 2 if bf16 else 4
    tokens = micro_batch_tokens
    layer_bytes = layer_activation_bytes(shape, width, min(sequence_length, tokens)) * tokens  # one layer's
    activations = (layers * h * width * tokens + layer_bytes) if gradient_checkpointing else layers * layer_bytes
    chunk = min(tokens, logits_chunk_tokens) if logits_chunk_tokens else tokens
    return {
        "weights": width * params / (world_size if zero_stage == 3 else 1) / GIB,
        "gradients": width * learned / (world_size if zero_stage >= 2 else 1) / GIB,
        "optimizer": (12 if bf16 else 8) * learned / (world_size if zero_stage >= 1 else 1) / GIB,
        # AdamW's step: torch's AdamW (foreach on GPUs, per tensor on CPUs) makes sqrt(second moment) as a new fp32
        # tensor the size of what it steps, the rank's flat fp32 partition under ZeRO (7.1 GiB a rank for 7.6B
        # weights over 4 ranks), alive beside everything above at the end of backward
        "optimizer_step": 4 * learned / (world_size if zero_stage >= 1 else 1) / GIB,
        "activations": activations / GIB,
        "logits": chunk * vocab * 4 * 4 / GIB,
        "head_gradient": (2 * vocab * h * width if trained is None else 0) / GIB,
    }


def trainer_rank_estimate(cfg, shape: dict) -> dict:
    """The config's trainer rank by component (trainer_rank_gib), with what it was computed for: `tokens`, the
    largest micro-batch's padded tokens; `longest`, the longest sample."""
    train, rollout = cfg.train, cfg.rollout
    per_rank = train.groups_per_step * rollout.n // train.world_size
    # Longest sample: vLLM's context limit when set, else the response limit plus a 1024-token prompt.
    longest = (rollout.vllm.max_model_len if rollout.engine == "vllm" and rollout.vllm.max_model_len
               else rollout.max_new_tokens + 1024)
    tokens = max(train.micro_batch_tokens, longest) if train.micro_batch_tokens else per_rank * longest
    parts = trainer_rank_gib(
        shape, world_size=train.world_size, zero_stage=train.zero_stage, bf16=train.dtype == "bf16",
        micro_batch_tokens=tokens, sequence_length=longest, logits_chunk_tokens=train.logits_chunk_tokens,
        gradient_checkpointing=train.gradient_checkpointing,
        trained=None if train.lora is None else lora_parameter_count(shape, train.lora.r, train.lora.target_modules),
    )
    return {"parts": parts, "total": sum(parts.values()), "tokens": tokens, "longest": longest}


def trainer_memory_problem(cfg, model_path: str | None, shape: dict | None = None) -> str | None:
    """Why the config's trainer rank cannot fit the GPUs its `ray.cluster` declares (None when it fits,
    or when the cluster or the model folder does not say enough to tell). `shape`: the model's, when it is
    known otherwise than from `model_path` (streamrl plan --model-config)."""
    groups = [g for g in cfg.ray.cluster or [] if g.num_gpus and g.gpu_memory_gb]
    if not groups or not cfg.train.num_gpus:
        return None
    shape = shape or (model_shape(model_path) if model_path else None)
    if shape is None:
        return None
    train = cfg.train
    estimate = trainer_rank_estimate(cfg, shape)
    parts, tokens, total = estimate["parts"], estimate["tokens"], estimate["total"]
    gpu_gib = min(g.gpu_memory_gb for g in groups)
    budget = 0.9 * gpu_gib * train.num_gpus
    if total <= budget:
        return None
    detail = ", ".join(f"{name} {gib:.1f}" for name, gib in parts.items())
    return (f"train.micro_batch_tokens: a rank needs an estimated {total:.0f} GiB ({detail}; {parameter_count(shape) / 1e9:.2f}B "
            f"parameters, micro-batches of {tokens} tokens) but has {budget:.0f} GiB (90% of {train.num_gpus:g} x "
            f"{gpu_gib:g} GiB, ray.cluster gpu_memory_gb). Set train.micro_batch_tokens "
            "(e.g. 16384), train.gradient_checkpointing: true, a higher train.zero_stage or more ranks, or a smaller "
            "train.logits_chunk_tokens")


# --- what goes through Ray's object store, node by node ---------------------------------------------

MIB = 2**20
# Versions of the policy's weights the object store may hold at once: the one generators load, the one
# rank 0 is putting (the store drops the old one only once the new one is published), and one a
# generator still reads while the next arrives.
VERSIONS_IN_FLIGHT = 3
RETAINED_FOR_EVAL = 2  # retained versions an evaluator that lags may not have read yet
OBJECT_STORE_HEADROOM_MB = 128  # Ray Data's blocks of groups in flight, and Ray's own objects


def policy_versions_in_store(cfg, may_run) -> tuple[int, str]:
    """Versions of the policy's weights one node's object store may hold, and why. `may_run(stage)`: whether
    the node may run that actor (pipelines/runtime/resources.py's stage names).

    On the weight plane (`weight_plane(cfg)` gloo: vLLM's in-flight engines on CPUs) engines take each
    version over vLLM's weight-transfer API, not the object store. What still goes through it: each version
    engines pull on the object-store plane (the HF engine, vLLM with in_flight false, and vLLM on GPUs until
    NCCL is wired; rank 0 puts it, every generate actor's node holds a copy while it reads), and the
    versions retained for the in-training evaluator (rank 0 puts them; the evaluator's node reads one at a
    time)."""
    live = VERSIONS_IN_FLIGHT if weight_plane(cfg) == "object_store" else 0
    retained = RETAINED_FOR_EVAL if cfg.eval is not None else 0
    why = " and ".join(reason for count, reason in ((live, "the HF engine pulls each version from the store"),
                                                   (retained, "versions retained for the evaluator")) if count)
    if may_run("train"):  # trainer rank 0 puts every version that goes through the store
        return live + retained, why
    reads = max(live if may_run("generate") else 0, 1 if retained and may_run("eval") else 0)
    return reads, why


def weight_channel_mb(cfg, model_path: str | None, stages: set[str] | None = None,
                      shape: dict | None = None) -> dict[str, float] | None:
    """MB of object store one node needs for what goes through it, from the model's config.json; None when
    the folder does not say enough. `stages`: the actors the node may run (resources.py's stage names,
    plus "driver"); None: all of them (one node runs the whole job). `shape`: the model's, when known
    otherwise (streamrl plan --model-config)."""
    shape = shape or (model_shape(model_path) if model_path else None)
    if shape is None:
        return None
    may_run = (lambda stage: True) if stages is None else stages.__contains__
    params = parameter_count(shape)
    policy_mb = params * (2 if cfg.train.dtype == "bf16" else 4) / MIB  # published in the training dtype
    copies, why = policy_versions_in_store(cfg, may_run)
    # the critic's rank 0 puts its weights in the store and the Value stage reads them (fp32: it trains in fp32)
    holds_critic = cfg.critic is not None and (may_run("critic") or may_run("value"))
    critic_mb = params * 4 / MIB * VERSIONS_IN_FLIGHT if holds_critic else 0.0
    blocks_mb = OBJECT_STORE_HEADROOM_MB if stages is None or stages else 0  # samples pass every node that runs a stage
    return {"policy_mb": policy_mb, "copies": copies, "why": why, "critic_mb": critic_mb, "blocks_mb": blocks_mb,
            "total_mb": policy_mb * copies + critic_mb + blocks_mb}


def object_store_problem(cfg, model_path: str, store_mb: float, where: str,
                         stages: set[str] | None = None) -> str | None:
    """Why an object store of `store_mb` (`where`: whose; "local": ray.object_store_memory_mb of a local
    cluster) cannot carry what its node may run (`stages`, see weight_channel_mb); None if it can."""
    need = weight_channel_mb(cfg, model_path, stages)
    if need is None or need["total_mb"] <= store_mb:
        return None
    parts = [f"{need['policy_mb']:.0f} MB of policy weights ({cfg.train.dtype}) x {need['copies']} versions "
             f"({need['why']})"] if need["copies"] else []
    if need["critic_mb"]:
        parts.append(f"{need['critic_mb']:.0f} MB for the critic's")
    if need["blocks_mb"]:
        parts.append(f"{need['blocks_mb']} MB for the DAG's blocks")
    fix = ("set ray.object_store_memory_mb to at least " + f"{math.ceil(need['total_mb'])}" if where == "local"
           else "start that node with `ray start --object-store-memory` of at least "
           f"{math.ceil(need['total_mb']) * MIB} bytes")
    halve = "" if cfg.train.dtype == "bf16" or not need["copies"] else ", or train.dtype: bf16 to halve the weights"
    on_gpus = cfg.rollout.num_gpus > 0 or cfg.train.num_gpus > 0  # GPUs: the object store until NCCL is wired
    skip = (", or rollout.engine: vllm (its in-flight engines take the weights on the weight plane, not the "
            "object store)" if cfg.rollout.engine == "hf" and not on_gpus and need["copies"] else "")
    place = "the local object store" if where == "local" else f"the object store of {where}"
    return (f"ray.object_store_memory_mb: about {need['total_mb']:.0f} MB goes through {place}: "
            f"{', '.join(parts)}; it has {store_mb:.0f} MB: {fix}{halve}{skip}")


# --- the local cluster's object store: its size, and its room in /dev/shm ----------------------------

LEAST_OBJECT_STORE_MB = 512  # Ray Data's blocks and Ray's own objects, when no weights go through the store
STORE_HEADROOM = 1.25  # over the estimate: it counts the weights and the DAG's blocks, not Ray's fragmentation
SHM = "/dev/shm"


def local_object_store_mb(cfg, model_path: str | None) -> int:
    """The object store a local cluster starts with: `ray.object_store_memory_mb` when the config sets it,
    else what goes through it (weight_channel_mb) with a quarter's headroom, in whole 64 MB, at least 512.
    A 7B model in bf16 on the object-store plane is 3 versions of 14.5 GB: ~55 GB with the headroom (~91 GB
    with an evaluator's 2 retained versions), where a fixed 512 MB default refused every such job."""
    if cfg.ray.object_store_memory_mb is not None:
        return cfg.ray.object_store_memory_mb
    need = weight_channel_mb(cfg, model_path) if model_path else None
    if need is None:
        return LEAST_OBJECT_STORE_MB
    return max(LEAST_OBJECT_STORE_MB, 64 * math.ceil(need["total_mb"] * STORE_HEADROOM / 64))


def shm_problem(store_mb: int, chosen: bool, shm: str = SHM) -> str | None:
    """Why `shm` cannot hold a local object store of `store_mb` (`chosen`: the config set the size); None when
    it can, or where there is no such folder (not Linux). On Linux Ray puts the store in /dev/shm, and where that
    has less room than the store, in /tmp on disk with a warning in its log: every weight version is then a
    disk write and read. A container's /dev/shm is 64 MB unless it is given more (docker's default)."""
    if not os.path.isdir(shm):
        return None
    free_mb = shutil.disk_usage(shm).free / MIB
    if free_mb >= store_mb:
        return None
    why = "as set" if chosen else "sized from the weights that go through it"
    return (f"ray.object_store_memory_mb: the local object store ({store_mb} MB, {why}) lives in {shm}, which has "
            f"{free_mb:.0f} MB free (Ray would put it in /tmp on disk, every weight version a disk write and "
            f"read). Give {shm} at least {store_mb} MB (`docker run --shm-size={math.ceil(store_mb / 1024)}g`; on "
            "Kubernetes an emptyDir with medium: Memory mounted there, as deploy/rayjob.yaml does), free what "
            f"is left in it, or set ray.object_store_memory_mb below {free_mb:.0f} if fewer versions go through it")
