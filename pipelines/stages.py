"""The RL job as a list of stages: what each stage of the Ray Data DAG runs, and how.

    schedule (prompt groups, each tagged with the train step it will feed)
      -> Generate   actor pool; admission-gated on the policy store (>= step - max_staleness)
      -> Reward     actor pool; weighted reward functions, failures contained (reward.placement
                    "generate": in the generate actors instead, one stage: GenerateReward)
      -> [Reference] a frozen reference policy's log-probs (the config's reference section)
      -> [Value]    PPO with a critic: per-token values from the critic store (its own DeepSpeed group)
      -> Advantage  group-relative estimator, or GAE from the values   } one stage, one actor
      -> Train      buffers a step's groups, steps the DeepSpeed group,  } (operators/stages/chain.py)
                    publishes weights

A `Stage` is a value: the callable class, its constructor arguments, and the `map_batches` options
(compute strategy, batch size and format, Ray options per actor), the way Ray Data LLM's
`StatefulStage` describes a stage before its `Processor` maps it. `stages(cfg, ...)` makes the list
from the config; pipelines/dag.py maps it onto the schedule. Nothing here starts an actor or touches
Ray Data's global context.

The helpers that only shape a stage live here too: `engine_options` (the generate engine's
constructor options, also the evaluator's), `pool_size` (an actor pool's size), `replica_placement`
(the generate actors' placement groups) and `TRAIN_CALLS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ray.data import ActorPoolStrategy

from operators.stages.advantage import Advantage
from operators.stages.chain import Chain
from operators.common.faults import FaultPoints
from operators.stages.generate import Generate
from operators.stages.ref_logprob import RefLogprob
from operators.stages.reward import Reward
from operators.stages.train import Train
from operators.stages.value import Value
from pipelines.config.job import JobConfig
from pipelines.config.model import ModelConfig
from pipelines.data.models import resolve_model_path
from pipelines.runtime.placement import ReplicaPlacement, engine_bundles, vllm_executor_backend
from pipelines.runtime.resources import DAG_HELPER_CPUS
from pipelines.runtime.rollout_settings import (actor_calls, environment_options, sandbox_limits, uses_in_flight,
                                                weight_plane)
from pipelines.runtime.trainer_settings import advantage_options, train_options

# Calls the last stage runs at once: one trains, the others take in groups meanwhile.
TRAIN_CALLS = 4


class AdvantageTrain(Chain):
    """The RL DAG's last stage: Advantage, then Train, in one actor."""


class GenerateReward(Chain):
    """The RL DAG's first stage with reward.placement "generate": Generate, then Reward, in one actor."""


@dataclass(frozen=True)
class Stage:
    """One stage of the RL DAG: `Dataset.map_batches(fn, fn_constructor_kwargs=kwargs, compute=compute,
    batch_size=batch_size, batch_format=batch_format)` with Ray `options` per actor (map_stage: named
    resources, actor options such as max_restarts, `ray_remote_args_fn`). `requires`/`produces`: the
    main columns it reads and adds (documentation; every stage passes the other columns through)."""

    fn: type
    kwargs: dict[str, Any]
    compute: ActorPoolStrategy
    options: dict[str, Any] = field(default_factory=dict)
    # None: one block is one call (a generate call never spans two steps)
    batch_size: int | None = None
    batch_format: str = "pandas"
    requires: tuple[str, ...] = ()
    produces: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.fn.__name__


def engine_options(cfg: JobConfig, engine: str | None = None, in_flight: bool = False,
                   replica_group: bool = False, plane: bool = False, adapters: bool = True) -> dict:
    """Constructor options of `engine` (default: the configured rollout engine; `in_flight`: its async form).
    `replica_group`: the engine runs in a generate replica's placement group (replica_placement), whose GPU
    bundles vLLM's Ray executor fills; otherwise a tensor-parallel engine uses the GPUs its actor holds.
    `plane`: the generate stage's engines, which receive policy versions on the weight plane when
    rollout.weight_transfer resolves to gloo (an evaluator's engine loads the versions it is handed).
    `adapters`: False for an engine that only ever loads whole checkpoints (`streamrl eval`, the race's
    scoring: a LoRA checkpoint's export is the merged policy), so vLLM's LoRA layers are not set up for it."""
    options = {"torch_threads": cfg.rollout.torch_threads, "trust_remote_code": cfg.model.trust_remote_code}
    if adapters and cfg.serves_adapters():  # every engine that loads versions gets adapters (the evaluator's too)
        lora = cfg.train.lora
        targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
        options["adapters"] = {"r": lora.r, "alpha": lora.alpha, "target_modules": targets,
                               "keep": cfg.train.max_staleness + 2}
    if (engine or cfg.rollout.engine) == "hf":  # it scores each response in the trainer's chunks
        options["logits_chunk_tokens"] = cfg.train.logits_chunk_tokens
    elif (engine or cfg.rollout.engine) == "vllm":
        options.update(cfg.rollout.vllm.model_dump(), seed=cfg.train.seed)
        if in_flight:
            options["max_num_seqs"] = cfg.rollout.max_seqs_in_flight
        if in_flight and plane and weight_plane(cfg) == "gloo":  # the generate stage's engines receive on the plane
            options.update(weight_transfer="gloo", weight_timeout_s=cfg.rollout.weight_timeout_s)
        backend = vllm_executor_backend(cfg.rollout.vllm.tensor_parallel_size,
                                        cfg.rollout.num_gpus if replica_group else 0)
        if backend is not None:
            options["distributed_executor_backend"] = backend
    return options


def pool_size(low: int, high: int) -> dict:
    """ActorPoolStrategy's size arguments: a fixed pool, or Ray Data's autoscaling pool from `low` to `high`
    (it starts `low` actors, adds one while every actor is busy and the cluster has room, and removes idle
    ones; a new generate actor pulls the newest policy version before its first group)."""
    return {"size": low} if low == high else {"min_size": low, "max_size": high, "initial_size": low}


def replica_placement(cfg: JobConfig) -> ReplicaPlacement | None:
    """A placement group per generate actor when one engine spans several devices (None otherwise: a
    one-device engine is one actor's reservation, which Ray already keeps on one node). Whoever runs the
    DAG calls `release()` when it ends (pipelines/recovery/attempts.py: run_attempt)."""
    rollout = cfg.rollout
    if rollout.vllm.tensor_parallel_size == 1:
        return None
    return ReplicaPlacement(
        engine_bundles(rollout.vllm.tensor_parallel_size, rollout.num_cpus, rollout.num_gpus, rollout.resources),
        replicas=rollout.min_actors,  # a count: a range needs tensor_parallel_size 1 (config)
    )


GENERATE_REQUIRES = ("prompt", "train_step", "group_uid")
GENERATE_PRODUCES = ("prompt_token_ids", "responses", "response_token_ids", "behavior_logprobs", "policy_version")
REWARD_PRODUCES = ("rewards", "reward_errors", "reward_timeouts")


def stages(cfg: JobConfig, model_path: str, store, workers, remote_args: dict[str, dict] | None = None,
           first_step: int = 0, checkpoint_options: dict | None = None, critics=None,
           replicas: ReplicaPlacement | None = None) -> list[Stage]:
    """The RL DAG's stages, in order. `store`: the policy store actor (the weight channel's handle, passed to every stage that reads it); `workers`: the trainer group.
    `remote_args` adds Ray options per stage ("generate", "reward", "reference"), e.g.
    {"generate": {"num_gpus": 1}} or {"generate": {"resources": {"sim_gpu": 4}}}. The schedule starts at
    `first_step`; `checkpoint_options` (see operators.stages.train.Train) turns checkpoints on. `critics`: the
    critic group (start_critic_group) when the config has a critic. `replicas`: the generate actors'
    placement groups (replica_placement(cfg)) when an engine spans several devices, else None."""
    remote_args = remote_args or {}
    generate_options = {"num_cpus": cfg.rollout.num_cpus, **remote_args.get("generate", {})}
    if replicas is not None:  # the group holds the engine's GPUs (vLLM's workers take them), the actor none
        generate_options.update(num_gpus=None, ray_remote_args_fn=replicas)
    in_flight, calls = uses_in_flight(cfg.rollout), actor_calls(cfg.rollout)
    # Call-synchronous engines take one call at a time and none is queued behind it at the actor: a queued call
    # can start first (Ray does not promise submission order to an actor whose tasks are retried; seen in CI and
    # here: a staleness-0 job's first call, for step 2, waited for version 1 while step 1's call sat behind it,
    # and the job hung before its first step). The next call is dispatched one executor round (10 ms) later.
    queued = calls if in_flight else 1
    generate = dict(
        model_path=model_path, engine=cfg.rollout.engine, n=cfg.rollout.n,
        max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p, seed=cfg.train.seed, policy_store=store,
        max_staleness=cfg.train.max_staleness,
        engine_options=engine_options(cfg, in_flight=in_flight, replica_group=replicas is not None, plane=True),
        in_flight=in_flight, max_seqs_in_flight=cfg.rollout.max_seqs_in_flight,
        partial_rollout=cfg.rollout.partial_rollout, update_when=cfg.rollout.update_when,
        faults=FaultPoints.from_environment(),  # armed only by a test or a chaos run (operators/common/faults.py)
        **cfg.prompt_options(),
    )
    if cfg.rollout.environment is not None:  # multi-turn episodes (operators/environments/environment.py)
        env = cfg.rollout.environment
        generate.update(environment=env.name, environment_options=environment_options(cfg), max_turns=env.max_turns,
                        max_episode_tokens=env.max_episode_tokens, episode_timeout_s=env.timeout_s)
    reward = dict(
        functions=cfg.reward.function_specs(), on_error=cfg.reward.on_error,
        timeout_s=cfg.reward.timeout_s, timestamps=True, limits=sandbox_limits(cfg.sandbox),
    )
    # reward.placement "generate": each group is scored in the generate actor that sampled it (one stage,
    # one executor hop less on the loop); "stage": a reward actor pool of its own.
    in_generate = cfg.reward.placement == "generate"
    out = [Stage(
        GenerateReward if in_generate else Generate,
        dict(stages=[(Generate, generate), (Reward, reward)]) if in_generate else generate,
        # In flight: `calls` calls per actor at once, each in its own thread (the engine runs on the
        # actor's rollout loop, so the calls only wait on it: whichever starts first, none waits behind
        # another); call-synchronous: one at a time (see `queued`).
        ActorPoolStrategy(**pool_size(cfg.rollout.min_actors, cfg.rollout.max_actors),
                          max_tasks_in_flight_per_actor=queued,
                          max_concurrent_calls_per_actor=calls if in_flight else None,
                          enable_true_multi_threading=True if in_flight else None),
        generate_options, requires=GENERATE_REQUIRES,
        produces=GENERATE_PRODUCES + (REWARD_PRODUCES if in_generate else ()),
    )]
    if not in_generate:
        out.append(Stage(Reward, reward, ActorPoolStrategy(size=cfg.reward.num_actors),
                         {"num_cpus": cfg.reward.num_cpus, **remote_args.get("reward", {})},
                         requires=("responses",), produces=REWARD_PRODUCES))
    # the design's ref_logprob stage: log-probs of a frozen reference policy (with train.lora, by default the
    # policy ranks compute them instead, adapters off: reference.on_trainer)
    if cfg.reference is not None and not cfg.reference_on_trainer():
        ref = cfg.reference
        out.append(Stage(
            RefLogprob,
            dict(
                model_path=(resolve_model_path(ModelConfig(path=ref.model_path), "reference.model_path")
                            if ref.model_path and ref.model_path != cfg.model.path else model_path),
                temperature=cfg.rollout.temperature, micro_batch_tokens=ref.micro_batch_tokens,
                torch_threads=ref.torch_threads, dtype=ref.dtype, trust_remote_code=cfg.model.trust_remote_code,
                logits_chunk_tokens=cfg.train.logits_chunk_tokens,  # the trainer's chunks: no [B, T, V] logits
                packing=cfg.train.packing, share_prompts=cfg.train.share_prompts,  # laid out as the trainer's
            ),
            ActorPoolStrategy(size=ref.num_actors), {"num_cpus": ref.num_cpus, **remote_args.get("reference", {})},
            requires=("prompt_token_ids", "response_token_ids"), produces=("ref_logprobs",),
        ))
    if critics is not None:
        out.append(Stage(
            Value,
            dict(model_path=critics.model_path, value_store=critics.store, torch_threads=cfg.critic.torch_threads,
                 trust_remote_code=cfg.model.trust_remote_code, packing=cfg.train.packing,
                 share_prompts=cfg.train.share_prompts),
            ActorPoolStrategy(size=1), {"num_cpus": cfg.critic.value_num_cpus},
            requires=("prompt_token_ids", "response_token_ids"), produces=("values", "critic_version"),
        ))
    # Advantage runs in the Train stage's actor: one executor trip less on the loop (operators/stages/chain.py).
    # Its state (buffered groups, the ledger) dies with it: no silent restart; the job restarts from the
    # last checkpoint instead (pipelines/recovery/attempts.py).
    out.append(Stage(
        AdvantageTrain,
        dict(stages=[
            (Advantage, advantage_options(cfg)),
            (Train, dict(
                workers=workers, groups_per_step=cfg.train.groups_per_step, total_steps=cfg.train.steps - first_step,
                generated_per_step=cfg.generated_groups_per_step(), dynamic_sampling=cfg.algorithm.dynamic_sampling,
                first_step=first_step, success_threshold=cfg.reward.success_threshold,
                reward_failed_steps=cfg.reward.stop_after_failed_steps, **train_options(cfg),
                critics=list(critics or []), **(checkpoint_options or {}),
            )),
        ]),
        # Calls side by side (threads): the next step's groups are taken in while a step trains, so that
        # step starts the moment this one ends (operators.stages.train.Train is safe for it).
        ActorPoolStrategy(size=1, max_tasks_in_flight_per_actor=TRAIN_CALLS,
                          max_concurrent_calls_per_actor=TRAIN_CALLS, enable_true_multi_threading=True),
        {"num_cpus": DAG_HELPER_CPUS, "max_restarts": 0},
        requires=("train_step", "group_uid", "rewards"), produces=("step", "timeline", "checkpoint_path"),
    ))
    return out
