"""A config against the world it names, in one pass once the schema holds (pipelines/config/schema.py checks
values and how they fit together, and imports none of this): the dataset files, the models, the cluster that
`ray.cluster` declares, and whether the trainer fits its GPUs. `config_from_tree` (pipelines/config/load.py)
runs it, so every `load_config` does; each problem is (field path, message) with the fix.

The form of a model path (a builtin, a Hub id, a local save_pretrained folder) is checked while the schema
validates, so that it is listed with every other field's problem: load.py validates with `SCHEMA_CONTEXT`,
which gives the schema pipelines/data/models.py's check.
"""

from __future__ import annotations

from pathlib import Path

from pipelines.config.schema import (BUILTIN_DATASET_PREFIX, BUILTIN_DATASETS, DATASET_SUFFIXES, MODEL_PATH_CHECK,
                                     DataConfig, JobConfig)
from pipelines.data.models import check_model_path  # standard library only at import: validation stays free of torch

# pydantic's validation context of a JobConfig (JobConfig.model_validate(tree, context=SCHEMA_CONTEXT)): the
# model.path, critic.model_path and reference.model_path validators check the path with it.
SCHEMA_CONTEXT = {MODEL_PATH_CHECK: check_model_path}


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
        misplaced = [f"{where}.{name}: applies only to reasoning_gym:<task> datasets, not to {path!r}; remove it"
                     for name, given in (("split", data.split != type(data).model_fields["split"].default),
                                         ("task_options", data.task_options))
                     if given]
        if misplaced:
            problems, resolved = dataset_problems(path, prompt_column, id_column, where)
            return misplaced + problems, resolved
    if path.startswith(BUILTIN_DATASET_PREFIX):
        name = path[len(BUILTIN_DATASET_PREFIX):]
        if name not in BUILTIN_DATASETS:
            return [f"{where}.path: unknown builtin dataset {name!r}; use one of {list(BUILTIN_DATASETS)}"], path
        return [], path
    file = Path(path).expanduser()
    if file.suffix not in DATASET_SUFFIXES:
        return [f"{where}.path: {path!r} has an unsupported suffix; use one of {list(DATASET_SUFFIXES)}"], path
    if not file.is_file():
        return [f"{where}.path: dataset file {path!r} does not exist; give an existing file"], path
    from pipelines.data.datasets import DatasetError, read_columns

    try:
        columns = read_columns(file)
    except DatasetError as err:  # names the file, what is wrong and the fix
        return [f"{where}.path: {err}"], path
    except Exception as err:  # a corrupt file must be named, not crash later in an actor
        return [f"{where}.path: cannot read {path!r} ({type(err).__name__}: {err}); check the file"], path
    if not columns:  # an empty .jsonl / .json: no rows, so no columns either
        return [f"{where}.path: {path!r} holds no prompts (no rows); give a dataset with at least one row"], path
    problems = [
        f"{where}.{field_name}: column {column!r} is not in {path!r}; its columns are {columns}"
        for field_name, column in (("prompt_column", prompt_column), ("id_column", id_column))
        if column is not None and column not in columns
    ]
    from pipelines.data.datasets import column_problems

    problems += [f"{field}: {message}" for field, message in column_problems(columns, prompt_column, id_column, path,
                                                                             where)]
    return problems, str(file.resolve())


