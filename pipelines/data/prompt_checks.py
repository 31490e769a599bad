"""Prompt rows checked before any Ray actor starts: every row (missing, non-string or empty prompts; malformed
chat messages; empty or duplicate ids; prompt tokens + `rollout.max_new_tokens` beyond the model's context),
and whether the chat template can render them, every kind of problem listed at once with the field, what is
wrong and the fix, or, with `data.invalid_prompts: drop`, those rows removed and reported.

`PromptRows` takes a dataset's rows a chunk at a time and remembers only the rows it flags: the one check of a
job's inputs (pipelines/data/inputs.py, `streamrl validate` and `streamrl run`) streams every file through it.
`validate_prompts` runs it on a table already read (the held-out prompts, pipelines/evaluation/).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from pipelines.config.base import ConfigError
from pipelines.config.data import DataConfig

if TYPE_CHECKING:
    from pipelines.config.job import JobConfig

SHOWN = 5  # ids listed per kind of problem


KIND_TEXT = {
    "missing_prompt": "have no prompt (missing/null value)",
    "not_a_string": "have a prompt that is neither text nor a list of chat messages",
    "bad_messages": "have malformed chat messages",
    "mixed_kinds": "hold another kind of prompt than the first row (text and chat messages cannot share a column)",
    "empty_prompt": "have an empty or whitespace-only prompt",
    "empty_id": "have an empty or missing id",
    "duplicate_id": "repeat an id of an earlier row (the ledger of trained prompts keys on ids)",
    "too_long": "are too long for the model",
}


@dataclass(frozen=True)
class LengthBudget:
    """How long a prompt may be: `limit` tokens (from `source`) less `after`, what `field` keeps for the response."""

    limit: int
    source: str
    field: str
    after: int


def length_budget(cfg: JobConfig, model_path: str, max_new_tokens: int | None = None) -> LengthBudget | None:
    """The prompt budget of `cfg`'s engine and model (None: the model's config.json gives no context length).
    Multi-turn: an episode's turns and observations share one budget after the prompt. `max_new_tokens`:
    another response length than rollout.max_new_tokens (the evaluator's)."""
    limit, source = model_context_length(cfg, model_path)
    if limit is None:
        return None
    env = cfg.rollout.environment
    if env is not None:
        return LengthBudget(limit, source, "rollout.environment.max_episode_tokens", env.max_episode_tokens)
    if max_new_tokens is not None and max_new_tokens != cfg.rollout.max_new_tokens:
        return LengthBudget(limit, source, "eval.max_new_tokens", max_new_tokens)
    return LengthBudget(limit, source, "rollout.max_new_tokens", cfg.rollout.max_new_tokens)


class PromptRows:
    """One dataset's rows, taken a chunk at a time (`add`) and checked as Generate will read them. `renderer`
    (operators.common.prompts.PromptRenderer) and `budget`: None when the model is not at hand, then lengths
    and the chat template are not checked. `where`: the dataset's section ("data", "eval.data")."""

    def __init__(self, data: DataConfig, where: str = "data", renderer=None, budget: LengthBudget | None = None):
        self.data, self.where, self.renderer, self.budget = data, where, renderer, budget
        self.rows = 0
        self.problems: dict[str, list[int]] = {}
        self.reasons: dict[int, str] = {}  # what is wrong with each row of malformed messages
        self.ids: dict[int, str] = {}  # the id of each flagged row
        self.seen: set[str] = set()
        self.kind: str | None = None  # "text" or "messages": the first well-formed row's
        self.messages = False  # a well-formed row is chat messages
        self.longest = 0
        self.templated_too_long: bool | None = None  # whether the first prompt too long was rendered by a template

    def add(self, prompts: list, ids: list[str] | None = None) -> None:
        """The next rows: their prompts and their ids as text (default: made from the row, as load_prompts does)."""
        offset = self.rows
        self.rows += len(prompts)
        ids = ids if ids is not None else [f"row-{offset + i:08d}" for i in range(len(prompts))]
        flagged = self._prompt_problems(prompts, ids, offset)
        flagged |= self._too_long(prompts, ids, offset, flagged)
        if self.data.id_column:
            for i, prompt_id in enumerate(ids):
                if i in flagged:
                    continue
                if not prompt_id.strip():
                    self._flag("empty_id", offset + i, prompt_id)
                elif prompt_id in self.seen:  # the first row with an id keeps it
                    self._flag("duplicate_id", offset + i, prompt_id)
                else:
                    self.seen.add(prompt_id)

    def _flag(self, kind: str, index: int, prompt_id: str, reason: str | None = None) -> None:
        self.problems.setdefault(kind, []).append(index)
        self.ids[index] = prompt_id
        if reason:
            self.reasons[index] = reason

    def _prompt_problems(self, prompts: list, ids: list[str], offset: int) -> set[int]:
        """Flag a missing, blank, malformed or non-text prompt, and a row of the other kind than the first
        well-formed row; the chunk's positions flagged."""
        from operators.common.prompts import is_messages, message_problem

        flagged = set()
        for i, prompt in enumerate(prompts):
            kind, reason, this = None, None, "text"
            if prompt is None or prompt is pd.NA or (isinstance(prompt, float) and np.isnan(prompt)):
                kind = "missing_prompt"
            elif is_messages(prompt):
                reason = message_problem(prompt)
                kind = "bad_messages" if reason else None
                this = "messages"
            elif not isinstance(prompt, str):
                kind = "not_a_string"
            elif not prompt.strip():
                kind = "empty_prompt"
            if kind is None:
                self.kind = self.kind or this
                kind = "mixed_kinds" if this != self.kind else None
                self.messages |= kind is None and this == "messages"
            if kind is not None:
                self._flag(kind, offset + i, ids[i], reason)
                flagged.add(i)
        return flagged

    def _too_long(self, prompts: list, ids: list[str], offset: int, flagged: set[int]) -> set[int]:
        """Flag the prompts whose tokens (rendered as Generate renders them) leave the response too little of
        the model's context; a prompt the format cannot render is left to `format_problems`."""
        renderer, budget = self.renderer, self.budget
        if renderer is None or budget is None or renderer.template_problem is not None:
            return set()
        candidates = [i for i in range(len(prompts)) if i not in flagged and renderer.problem(prompts[i]) is None]
        if not candidates:
            return set()
        counts = prompt_token_counts([prompts[i] for i in candidates], renderer)
        self.longest = max(self.longest, int(counts.max()))
        too_long = {i for i, count in zip(candidates, counts) if count > budget.limit - budget.after}
        for i in sorted(too_long):
            self._flag("too_long", offset + i, ids[i])
            if self.templated_too_long is None:
                self.templated_too_long = renderer.uses_template(prompts[i])
        return too_long

    def format_problems(self) -> list[tuple[str, str]]:
        """Problems of the prompt format as a whole (not fixed by dropping rows): a chat template that does not
        render, chat messages or a system prompt with no chat template to render them."""
        renderer, field = self.renderer, f"{self.where}.chat_template"
        if renderer is None:
            return []
        fmt = renderer.fmt
        if self.messages and fmt.chat_template == "none":
            return [(field, "the prompts are chat messages, which 'none' cannot render; use 'auto' (the "
                     "tokenizer's chat template) or a Jinja template file")]
        needed = renderer.template is not None or self.messages or fmt.system_prompt is not None
        if renderer.template_problem is not None and needed and fmt.chat_template != "none":
            return [(field, renderer.template_problem)]
        if renderer.has_template or fmt.chat_template == "none":
            return []
        if self.messages:
            return [(field, "the prompts are chat messages, but the model's tokenizer has no chat template; set "
                     f"{field} to a Jinja template file, or give text prompts")]
        if fmt.system_prompt is not None:
            return [(f"{self.where}.system_prompt", "a system prompt needs a chat template, and the model's "
                     f"tokenizer has none; set {field} to a Jinja template file, or remove "
                     f"{self.where}.system_prompt")]
        return []

    def _label(self, index: int) -> str:
        prompt_id = self.ids[index]
        return f"{prompt_id!r} (row {index})" if self.data.id_column and prompt_id.strip() else f"row {index}"

    def describe(self, suggest_drop: bool = True) -> list[tuple[str, str]]:
        """One problem per kind: the count, the first few rows (with what is wrong, for malformed messages), the
        fix."""
        out = []
        for kind, rows in self.problems.items():
            shown = ", ".join(self._label(i) + (f" ({self.reasons[i]})" if i in self.reasons else "")
                              for i in rows[:SHOWN]) + (", ..." if len(rows) > SHOWN else "")
            detail, fix = "", f"fix or remove them (column {self.data.prompt_column!r})"
            if kind == "too_long":
                budget = self.budget
                templated = " (chat template applied)" if self.templated_too_long else ""
                detail = (f" (prompt tokens{templated} + {budget.field}={budget.after} must be at most "
                          f"{budget.limit}, from {budget.source}; the longest prompt has {self.longest} tokens)")
                fix = f"shorten or remove them, or lower {budget.field}"
            elif kind == "empty_id":
                fix = f"give every row an id in column {self.data.id_column!r}"
            elif kind == "duplicate_id":
                fix = f"make the ids in column {self.data.id_column!r} unique"
            drop = f", or set {self.where}.invalid_prompts: drop to skip them" if suggest_drop else ""
            out.append((f"{self.where}.path", f"{len(rows)} of {self.rows} rows {KIND_TEXT[kind]}{detail}: {shown} "
                        f"(rows count from 0, header excluded); {fix}{drop}"))
        return out

    def outcome(self) -> tuple[list[tuple[str, str]], list[int], dict[str, list[str]]]:
        """(problems, the positions of the rows to drop, the report: per kind the ids of its rows dropped).

        Problems: no rows; a format that cannot render the prompts (whatever invalid_prompts says); with
        invalid_prompts: error any invalid row; with drop, every row invalid."""
        if self.rows == 0:
            return [(f"{self.where}.path", f"{self.data.path!r} holds no prompts (0 rows); give a dataset with at "
                     "least one row")], [], {}
        found = self.format_problems()
        if found:
            return found + self.describe(), [], {}
        if not self.problems:
            return [], [], {}
        if self.data.invalid_prompts == "error":
            return self.describe(), [], {}
        dropped = sorted({index for rows in self.problems.values() for index in rows})
        if len(dropped) == self.rows:
            return ([(f"{self.where}.invalid_prompts", f"all {self.rows} prompts are invalid, so none is left to "
                      "train on")] + self.describe(suggest_drop=False)), [], {}
        report = {kind: [self.ids[i] or f"row {i}" for i in rows] for kind, rows in self.problems.items()}
        return [], dropped, report


def model_context_length(cfg: JobConfig, model_path: str) -> tuple[int | None, str]:
    """Longest prompt + response the rollout engine takes, and where that number comes from."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    sections = [config, config.get("text_config") or {}]
    keys = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
    limit, source = None, "no context length in the model's config.json"
    for section in sections:
        found = next((key for key in keys if isinstance(section.get(key), int)), None)
        if found:
            limit, source = section[found], f"the model's {found}={section[found]}"
            break
    max_model_len = cfg.rollout.vllm.max_model_len
    if cfg.rollout.engine == "vllm" and (limit is None or max_model_len < limit):
        limit, source = max_model_len, f"rollout.vllm.max_model_len={max_model_len}"
    return limit, source


def load_tokenizer(model_path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True, trust_remote_code=trust_remote_code)


def prompt_token_counts(prompts: list, renderer) -> np.ndarray:
    """Tokens per prompt as Generate encodes them (operators.common.prompts.PromptRenderer: the chat template
    applied where it is), batch-encoded: a fast tokenizer's Rust batch encoder (parallel, no offsets)
    where there is one."""
    tokenizer = renderer.tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    fast_batch = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)
    counts = np.zeros(len(prompts), dtype=np.int64)
    templated = np.array([renderer.uses_template(p) for p in prompts], dtype=bool)
    chunk = 16384  # bounds memory on large datasets
    for special in (True, False):  # text as it is (with the tokenizer's special tokens), templated without
        indices = np.flatnonzero(templated != special)
        for start in range(0, len(indices), chunk):
            part = indices[start:start + chunk]
            texts = [renderer.render(prompts[i]) for i in part]
            if fast_batch is not None:
                lengths = [len(encoding) for encoding in fast_batch(texts, add_special_tokens=special)]
            else:  # a slow (Python) tokenizer
                lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=special)["input_ids"]]
            counts[part] = lengths
    return counts


def validate_prompts(prompts: pd.DataFrame, cfg: JobConfig, model_path: str,
                     prompt_options: dict | None = None) -> tuple[pd.DataFrame, dict]:
    """Check every row of a prompt table (`load_prompts`'s); return the rows kept and a report of the rows dropped.

    Prompts are rendered as Generate renders them (operators/common/prompts.py; `prompt_options`: the
    PromptFormat fields, default `cfg.prompt_options()`), so lengths count the chat template too.
    A format that cannot render the prompts (chat messages or a system prompt without a chat template, a
    template that does not render) is an error whatever `invalid_prompts` says.

    Invalid rows: a missing, empty or whitespace-only prompt, one that is neither text nor chat
    messages, malformed messages (each row's problem is named), a row of the other kind than the first
    (text among messages or messages among text); with `data.id_column`,
    an empty id or one an earlier row already has (the first row keeps it); a prompt whose tokens
    (the model folder's tokenizer, as the engines encode it) plus `rollout.max_new_tokens` exceed
    the model's context (config.json `max_position_embeddings`, or `rollout.vllm.max_model_len`
    with the vLLM engine, whichever is smaller).

    With `data.invalid_prompts: error` any invalid row raises `ConfigError`: per kind, the count,
    the first rows and the fix. With `drop` the rows are removed; the report maps each kind
    ("missing_prompt", "not_a_string", "bad_messages", "mixed_kinds", "empty_prompt", "empty_id",
    "duplicate_id", "too_long")
    to the prompt ids of its dropped rows (only kinds that occurred; `{}` when all are valid).
    Dropping every row is an error too. A row counts under its first kind only.
    """
    from operators.common.prompts import PromptError, PromptFormat, PromptRenderer

    data = cfg.data
    frame = prompts.reset_index(drop=True)
    try:
        renderer = PromptRenderer(load_tokenizer(model_path, cfg.model.trust_remote_code),
                                  PromptFormat(**(prompt_options or cfg.prompt_options())))
    except PromptError as err:  # a template file that does not exist
        raise ConfigError([("data.chat_template", str(err))], data.path) from None
    rows = PromptRows(data, "data", renderer, length_budget(cfg, model_path))
    rows.add(frame["prompt"].tolist(), frame["prompt_id"].astype(str).tolist())
    problems, dropped, report = rows.outcome()
    if problems:
        raise ConfigError(problems, data.path)
    return frame.drop(index=dropped).reset_index(drop=True), report
