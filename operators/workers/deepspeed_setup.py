"""How a trainer rank comes up: the rendezvous with the other ranks, DeepSpeed's config, the model under
ZeRO-3's partitioned init, the engine (optimizer, LR schedule) and glibc's malloc_trim on a CPU rank.

Plumbing only: no algorithm is decided here. operators/workers/train_worker.py calls these in order.
"""

from __future__ import annotations

import os
import socket

from operators.common.devices import dist_backend
from operators.workers.settings import TrainerSettings


def rendezvous_env(rank: int, world_size: int, master_port: int, device_type: str) -> None:
    """The environment torch.distributed and DeepSpeed read to find the other ranks."""
    os.environ.update({
        "MASTER_ADDR": os.environ.get("STREAMRL_MASTER_ADDR", "127.0.0.1"),
        "MASTER_PORT": str(master_port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
        # One GPU per rank actor, so its local rank is 0; DeepSpeed's accelerator follows the device.
        "LOCAL_RANK": "0", "DS_ACCELERATOR": device_type,
    })


def start_deepspeed(torch, settings: TrainerSettings, device_type: str):
    """Import DeepSpeed (after `rendezvous_env`: it reads the accelerator from it), seed torch and join
    the process group. Returns the deepspeed module."""
    import deepspeed

    # No JIT-compiled ops: the shared-memory comm op and fused Adam each cost 20-40 s to build on CPU.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    torch.set_num_threads(settings.torch_threads)
    torch.manual_seed(settings.seed)
    deepspeed.init_distributed(dist_backend=dist_backend(device_type))
    return deepspeed


def deepspeed_config(settings: TrainerSettings, world_size: int) -> dict:
    """The DeepSpeed config of a rank. Batch sizes: a train step is `ppo_epochs x mini_batches`
    optimizer steps, each accumulating the gradients of a number of micro-batches that depends on the
    step's lengths (`micro_batch_tokens`), so the trainer marks the accumulation boundary itself
    (`set_gradient_accumulation_boundary`, DeepSpeed's public API for variable accumulation) and the
    fixed sizes below only satisfy DeepSpeed's batch-size check (train = micro x accumulation x ranks).
    bf16: DeepSpeed keeps fp32 master weights and optimizer state, the module computes in bf16."""
    zero = {"stage": settings.zero_stage}
    if settings.zero3_persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = settings.zero3_persistence_threshold
    return {
        "train_batch_size": world_size,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": settings.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # check_grad_overflow (DeepSpeed's default, set here because the NaN guard relies on it): a step
        # whose gradient norm is not finite is skipped and its gradients dropped (discard_gradients in
        # operators/workers/engine_steps.py).
        "bf16": {"enabled": settings.dtype == "bf16", "check_grad_overflow": True},
        "steps_per_print": 10**9,
    }


def zero3_init(settings: TrainerSettings, config: dict):
    """Under ZeRO-3, an object that, while it lives, makes from_pretrained build the model inside
    deepspeed.zero.Init, so each parameter is partitioned as it is created and loaded: no rank ever holds
    the whole model. None under the other stages. The caller keeps it alive as long as the model."""
    if settings.zero_stage != 3:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(config)


def build_engine(torch, deepspeed, model, settings: TrainerSettings, config: dict):
    """The DeepSpeed engine that trains `model`: AdamW with the settings' lr, betas and weight decay over the
    parameters that require gradients (all of them, or a LoRA rank's adapters: the optimizer holds no state for
    frozen weights), the LR schedule, and gradient checkpointing when asked for."""
    if settings.gradient_checkpointing:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=settings.lr, betas=settings.betas,
        weight_decay=settings.weight_decay,
    )
    schedule = settings.lr_schedule
    # Stepped by DeepSpeed after each optimizer step; saved and restored with the engine's checkpoint.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule.factor(step))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine


def libc_malloc_trim():
    """glibc's malloc_trim, or None where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def host_memory_release(device_type: str):
    """What a rank calls after each micro-batch's backward: on a CPU rank, hand the memory it freed back to
    the OS. glibc keeps freed blocks below its (self-raising) mmap threshold in its heap, so without this a
    step of many micro-batches of varying shapes grows the resident memory with the number of micro-batches
    (measured: +2.3 GiB from 3 to 11 micro-batches, benchmarks/train_memory.py). GPU memory is the CUDA
    caching allocator's and is not affected: nothing to do there (nor where the C library is not glibc)."""
    trim = libc_malloc_trim() if device_type == "cpu" else None
    return (lambda: trim(0)) if trim is not None else (lambda: None)


def free_port() -> int:
    """A TCP port free on this machine now, for a rank group's rendezvous (MASTER_PORT)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
