"""What the config asks of the rollout side's operators, resolved with the operators' own rules: whether
generation keeps requests in flight and how many calls each actor runs, which weight transfer the versions
take, the environment's options and the sandbox's limits. The job (pipelines/stages.py, pipelines/dag.py),
the evaluator (pipelines/evaluation/in_training.py) and the trainer's settings
(pipelines/runtime/trainer_settings.py) read them here; the config sections only hold the fields."""

from __future__ import annotations

from operators.engines.factory import has_in_flight_form
from operators.environments.sandbox import SandboxLimits
from pipelines.config.job import JobConfig
from pipelines.config.reward import SandboxConfig
from pipelines.config.rollout import RolloutConfig


def uses_in_flight(rollout: RolloutConfig) -> bool:
    """rollout.in_flight resolved for the engine, an engine class set in code included (its `stream`)."""
    return has_in_flight_form(rollout.engine) if rollout.in_flight is None else bool(rollout.in_flight)


def actor_calls(rollout: RolloutConfig) -> int:
    """Generate calls each actor runs at once (1 when call-synchronous)."""
    if not uses_in_flight(rollout):
        return 1
    if rollout.calls_in_flight:
        return rollout.calls_in_flight
    return -(-rollout.max_seqs_in_flight // (rollout.groups_per_call * rollout.n)) + 1


def weight_plane(cfg: JobConfig) -> str:
    """rollout.weight_transfer resolved: 'gloo' or 'object_store' (see its description)."""
    asked, rollout = cfg.rollout.weight_transfer, cfg.rollout
    if asked != "auto":
        return asked
    if cfg.serves_adapters():  # a version is its LoRA adapter, a few MB: each engine pulls it
        return "object_store"
    on_gpus = rollout.num_gpus > 0 or cfg.train.num_gpus > 0
    return "gloo" if (rollout.engine == "vllm" and uses_in_flight(rollout) and not on_gpus) else "object_store"


def sandbox_limits(sandbox: SandboxConfig) -> SandboxLimits:
    """The sandbox section as operators.environments.sandbox.SandboxLimits."""
    mib = 2**20
    return SandboxLimits(address_space_bytes=sandbox.memory_mb * mib, cpu_seconds=sandbox.cpu_seconds,
                         file_size_bytes=sandbox.file_size_mb * mib, max_processes=sandbox.max_processes,
                         max_reply_bytes=int(sandbox.max_reply_mb * mib), isolate_network=not sandbox.network,
                         pass_env=tuple(sandbox.pass_env))


def environment_options(cfg: JobConfig) -> dict:
    """rollout.environment's options as its class takes them: the builtin tool environment also gets the
    sandbox's limits (operators/environments/environment.py)."""
    from operators.environments.environment import ENVIRONMENTS, ToolEnvironment

    env = cfg.rollout.environment
    options = dict(env.options)
    if ":" not in env.name and env.name in ENVIRONMENTS and issubclass(ENVIRONMENTS.get(env.name), ToolEnvironment):
        options["limits"] = sandbox_limits(cfg.sandbox)
    return options
