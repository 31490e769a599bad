"""The one check of everything a job reads, before anything starts. `streamrl validate` and `streamrl run` both
call `check_inputs` (a job after it has downloaded or built its models), which lists every problem at once as
one `ConfigError` (exit 2), each with its field and the fix:

- the models (pipelines/data/models.py, `job_model_folders`): a Hub id resolved in the cache, the policy's
  folder (config.json, code of its own without model.trust_remote_code, a weights file, a tokenizer);
- each dataset (`data`, `eval.data`), streamed a chunk of rows at a time (pipelines/data/datasets.py,
  `data_chunks`: no copy of the file is held): every row readable, every prompt and id, every prompt's
  length with the chat template applied against the model's context and rollout.vllm.max_model_len
  (pipelines/data/prompt_checks.py, `PromptRows`); the chat template: the file exists and renders, chat
  prompts or a system prompt have one;
- the columns every reward function takes (its signature: operators/stages/reward.py, `call_problem`) and
  the environment reads (its `columns`), in every dataset.

The tokenizer's batch encoder counts the tokens: 50,000 rows take seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pandas as pd

from pipelines.config.base import ConfigError
from pipelines.config.data import DataConfig
from pipelines.config.job import JobConfig
from pipelines.data.datasets import (
    DatasetError, MappingError, data_chunks, id_text, load_prompts, made_prompts, with_mapped_columns,
)
from pipelines.data.models import job_model_folders
from pipelines.data.prompt_checks import PromptRows, length_budget, load_tokenizer

Problems = list[tuple[str, str]]


@dataclass
class CheckedInputs:
    """What the check found: the policy's folder (None where `streamrl validate` finds a builtin not built yet),
    per dataset section the positions of the rows to drop and the report of them (data.invalid_prompts: drop),
    and the tables streamrl made itself (builtin, reasoning_gym), kept so a job does not make them twice."""

    model_path: str | None
    dropped: dict[str, tuple[list[int], dict[str, list[str]]]] = field(default_factory=dict)
    made: dict[str, pd.DataFrame] = field(default_factory=dict)

    def prompts(self, data: DataConfig, echo: Callable[[str], None] = print) -> tuple[pd.DataFrame, str]:
        """The training prompts (read once more: the check held no copy), without the rows it dropped."""
        frame, source = (self.made["data"], data.path) if "data" in self.made else load_prompts(data)
        positions, report = self.dropped.get("data", ([], {}))
        say_dropped("data", report, echo)
        return frame.drop(index=positions).reset_index(drop=True), source


def say_dropped(where: str, report: dict[str, list[str]], echo: Callable[[str], None], done: bool = True) -> None:
    for kind, ids in report.items():
        verb = "dropped" if done else "would drop"
        echo(f"streamrl: {verb} {len(ids)} {kind.replace('_', ' ')} prompt(s) ({where}.invalid_prompts: drop), "
             f"e.g. {', '.join(map(str, ids[:5]))}")


def check_inputs(cfg: JobConfig, echo: Callable[[str], None] = print, resolve: bool = False,
                 source: str = "config") -> CheckedInputs:
    """Check everything `cfg` reads; ConfigError listing every problem. `resolve` (a job): the models are
    downloaded or built first, once; otherwise (`streamrl validate`) nothing is downloaded or built, and a
    builtin model not built yet leaves the lengths and the chat template to the job's check."""
    model_path, problems = job_model_folders(cfg, resolve, echo)
    tokenizer = None
    if model_path is not None and not any(path == "model.path" for path, _ in problems):
        tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
    elif model_path is None and not problems:
        echo(f"streamrl: {cfg.model.path} is not built yet; `streamrl run` builds it, then checks the prompts' "
             "lengths and the chat template against it")
    sections = [("data", cfg.data, cfg.prompt_options(), None)]
    if cfg.eval is not None:
        sections.append(("eval.data", cfg.eval.data, cfg.prompt_options(held_out=True),
                         cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens))
    inputs = CheckedInputs(model_path)
    for where, data, options, max_new_tokens in sections:
        renderer, found = _renderer(tokenizer, options, where)
        budget = length_budget(cfg, model_path, max_new_tokens) if renderer is not None else None
        rows = PromptRows(data, where, renderer, budget)
        columns, read_problems, made = _read(data, where, rows)
        problems += found + read_problems
        if made is not None and where == "data":
            inputs.made[where] = made
        if columns is None:
            continue
        if not read_problems:
            found, positions, report = rows.outcome()
            problems += found
            inputs.dropped[where] = (positions, report)
            if not resolve:
                say_dropped(where, report, echo, done=False)
        problems += column_problems(cfg, columns, where, data.path)
    from pipelines.runtime.session import local_gpu_problems, local_store_problems

    # What the local cluster a job started here would lack, before the MLflow run. `streamrl validate` says it
    # too, unless the config declares the cluster it is written for (ray.cluster: checked against that plan,
    # e.g. a GPU config validated on a laptop before `streamrl submit`).
    if resolve or cfg.ray.cluster is None:
        problems += local_gpu_problems(cfg) + local_store_problems(cfg, model_path)
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)), source)
    return inputs


def _renderer(tokenizer, options: dict, where: str):
    """The prompts' renderer (None without a tokenizer), and a template file that does not exist."""
    from operators.common.prompts import PromptError, PromptFormat, PromptRenderer

    if tokenizer is None:
        return None, []
    try:
        return PromptRenderer(tokenizer, PromptFormat(**options)), []
    except PromptError as err:
        return None, [(f"{where}.chat_template", str(err))]


def _read(data: DataConfig, where: str, rows: PromptRows) -> tuple[list[str] | None, Problems, pd.DataFrame | None]:
    """Every row of the dataset through `rows`: (its columns, the prompt column named `prompt`, or None when not
    even they could be read; what could not be read; the table when streamrl made it)."""
    try:
        made = made_prompts(data)
    except ConfigError as err:
        return None, [(path if path.startswith(where) else f"{where}.path", message)
                      for path, message in err.problems], None
    if made is not None:
        rows.add(made["prompt"].tolist(), made["prompt_id"].astype(str).tolist())
        return list(made.columns), [], made
    columns: dict[str, None] = {}  # in order, the union of every chunk's (JSON lines need not share keys)
    first_row = 0
    try:
        for chunk in data_chunks(data, where):
            chunk = with_mapped_columns(chunk, data.columns, data.path, first_row)
            first_row += len(chunk)
            columns.update(dict.fromkeys(chunk.columns))
            size = len(chunk)
            prompts = chunk[data.prompt_column].tolist() if data.prompt_column in chunk else [None] * size
            ids = None
            if data.id_column:
                ids = [id_text(value) for value in chunk[data.id_column]] if data.id_column in chunk else [""] * size
            rows.add(prompts, ids)
    except DatasetError as err:
        field = f"{where}.columns.{err.column}" if isinstance(err, MappingError) else f"{where}.path"
        return (_as_read(list(columns), data) if columns else None), [(field, str(err))], None
    return _as_read(list(columns), data), [], None


def _as_read(columns: list[str], data: DataConfig) -> list[str]:
    """The columns as a job's rows have them: the prompt column named `prompt`, the id in `prompt_id`."""
    return [("prompt" if column == data.prompt_column else column) for column in columns] + ["prompt_id"]


def column_problems(cfg: JobConfig, columns: list[str], where: str, path: str) -> Problems:
    """The reward functions that take an argument no column of the dataset gives (or no argument for the
    completions), and the columns the environment reads that the dataset lacks."""
    from operators.stages.reward import resolve_reward_function, reward_columns
    from operators.stages.reward_calls import call_problem, reward_style, style_columns

    given = reward_columns(columns + (["epoch"] if where == "data" else []))  # the schedule adds each row's epoch
    problems = []
    for index, function in enumerate(cfg.reward.functions):
        fn = resolve_reward_function(function.name)
        problem = call_problem(fn, style_columns(given, reward_style(fn, function.style)), f"{where}.path {path!r}")
        if problem:
            problems.append((f"reward.functions.{index}.name", f"reward function {function.name!r} {problem}"))
    environment = cfg.rollout.environment
    if environment is not None:
        from operators.environments.agents import is_agent, resolve_agent
        from operators.environments.environment import resolve_environment

        resolve = resolve_agent if is_agent(environment.name) else resolve_environment
        missing = [c for c in getattr(resolve(environment.name), "columns", ()) if c not in columns]
        if missing:
            problems.append(("rollout.environment.name", f"environment {environment.name!r} reads the column(s) "
                             f"{missing} of every row, which {where}.path {path!r} lacks (its columns: {columns}); "
                             "add them to the dataset, or use an environment that does not read them"))
    return problems
