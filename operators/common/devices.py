"""Which device a trainer rank or an engine computes on, and which collective backend it uses.

Ray makes the GPUs it assigned to an actor visible to it alone (`CUDA_VISIBLE_DEVICES`), so an
actor given one GPU sees it as `cuda:0`. Ray leaves `CUDA_VISIBLE_DEVICES` unset for an actor that
asked for no GPU, so such an actor on a GPU node still *sees* every GPU: "torch sees CUDA" is not
"this process was given a GPU". The rule here, for each process:

- inside a Ray worker: CUDA when Ray assigned it at least one GPU, else the CPU;
- outside Ray (a plain loop, a notebook): CUDA when torch sees one, else the CPU;
- given a GPU but torch has no CUDA (a CPU build of torch on a GPU node): a clear error, not a
  silent CPU run 100x slower than asked.
"""

from __future__ import annotations


class DeviceError(RuntimeError):
    """A process was given an accelerator it cannot use."""


def choose_device(assigned_gpus: int | None, cuda_available: bool, role: str = "this process") -> str:
    """"cuda" or "cpu". `assigned_gpus`: how many GPUs Ray assigned (None outside Ray)."""
    if assigned_gpus is None:
        return "cuda" if cuda_available else "cpu"
    if assigned_gpus <= 0:
        return "cpu"
    if not cuda_available:
        raise DeviceError(
            f"{role} was given {assigned_gpus} GPU(s) by Ray but this torch has no CUDA (a CPU build, or no "
            "driver). On GPU nodes start Ray from the GPU environment (`make install-gpu` builds .venv-gpu; "
            "`. .venv-gpu/bin/activate` before `ray start`), or set the section's num_gpus: 0 to run on CPUs"
        )
    return "cuda"


def dist_backend(device_type: str) -> str:
    """The torch.distributed backend for ranks on `device_type`: NCCL between GPUs, gloo on CPUs."""
    return "nccl" if device_type == "cuda" else "gloo"


def ray_assigned_gpus() -> int | None:
    """How many GPUs Ray assigned to this worker; None when this process is not a Ray worker."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    # The runtime context's worker mode tells a driver from a worker without the warning that
    # get_task_id() logs on a driver. A driver holds no GPU assignment: it uses what torch sees.
    if ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
        return None
    return len(ray.get_gpu_ids())


def local_device(torch, role: str = "this process"):
    """The torch.device this process computes on (see the module docstring); sets the current
    CUDA device so that NCCL and DeepSpeed pick the same one."""
    kind = choose_device(ray_assigned_gpus(), torch.cuda.is_available(), role)
    device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    return device


def refuse_zero3_partitioned_build(role: str) -> None:
    """Raise a clear error where a model built now would come out partitioned: a DeepSpeed ZeRO-3 trainer rank
    lives in this process. While it does, transformers' HfDeepSpeedConfig (operators/workers/deepspeed_setup.py:
    zero3_init) builds every from_pretrained in the process under deepspeed.zero.Init, so an engine, reference
    model or critic built after it holds empty shards and fails on its first forward with a shape error.
    The Ray job runs each in an actor of its own; a one-process loop builds them before the trainer rank
    (pipelines/plain_loop.py, benchmarks/gpu_smoke.py)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        raise DeviceError(
            f"{role} would be built partitioned: a DeepSpeed ZeRO-3 trainer rank lives in this process, and while "
            "it does every from_pretrained builds its model in ZeRO-3 shards. Build it before the trainer rank "
            "(as pipelines/plain_loop.py does), or in a process of its own"
        )
