"""Prompt rows checked before any Ray actor starts (`validate_prompts`): every row (missing, non-string
or empty prompts; empty or duplicate ids; prompt tokens + `rollout.max_new_tokens` beyond the model's
context), every kind of problem listed at once as a `ConfigError` with the field, what is wrong and the
fix, or, with `data.invalid_prompts: drop`, those rows removed and reported. The rows come from
pipelines/data/datasets.py (`load_prompts`).
"""

from __future__ import annotations

import json
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


def _prompt_problems(frame: pd.DataFrame) -> tuple[dict[str, list[int]], dict[int, str]]:
    """Row positions with a missing, blank, malformed or non-text prompt, per kind, and what is wrong
    with each row of malformed chat messages. A column holds text or messages: rows of the other kind
    than the first well-formed row are `mixed_kinds`."""
    from operators.common.prompts import is_messages, message_problem

    problems: dict[str, list[int]] = {}
    reasons: dict[int, str] = {}
    kind = None
    for index, prompt in enumerate(frame["prompt"].tolist()):
        if prompt is None or prompt is pd.NA or (isinstance(prompt, float) and np.isnan(prompt)):
            problems.setdefault("missing_prompt", []).append(index)
            continue
        if is_messages(prompt):
            reason = message_problem(prompt)
            if reason:
                problems.setdefault("bad_messages", []).append(index)
                reasons[index] = reason
                continue
            this = "messages"
        elif not isinstance(prompt, str):
            problems.setdefault("not_a_string", []).append(index)
            continue
        elif not prompt.strip():
            problems.setdefault("empty_prompt", []).append(index)
            continue
        else:
            this = "text"
        kind = kind or this
        if this != kind:
            problems.setdefault("mixed_kinds", []).append(index)
    return problems, reasons


def _format_problems(frame: pd.DataFrame, renderer, skip: set[int]) -> list[tuple[str, str]]:
    """Problems of the prompt format as a whole (not fixed by dropping rows): chat messages or a system
    prompt with no chat template to render them."""
    from operators.common.prompts import is_messages

    prompts = frame["prompt"].tolist()
    messages = any(is_messages(prompts[i]) for i in range(len(prompts)) if i not in skip)
    fmt = renderer.fmt
    if messages and fmt.chat_template == "none":
        return [("data.chat_template", "the prompts are chat messages, which 'none' cannot render; use 'auto' (the "
                 "tokenizer's chat template) or a Jinja template file")]
    if renderer.has_template or fmt.chat_template == "none":
        return []
    if messages:
        return [("data.chat_template", "the prompts are chat messages, but the model's tokenizer has no chat "
                 "template; set data.chat_template to a Jinja template file, or give text prompts")]
    if fmt.system_prompt is not None:
        return [("data.system_prompt", "a system prompt needs a chat template, and the model's tokenizer has none; "
                 "set data.chat_template to a Jinja template file, or remove data.system_prompt")]
    return []


def _id_problems(frame: pd.DataFrame, data: DataConfig, skip: set[int]) -> dict[str, list[int]]:
    """Rows (not in `skip`) with an empty id, or an id an earlier row (not in `skip`) already has."""
    problems: dict[str, list[int]] = {}
    if not data.id_column:
        return problems  # ids made from the row index are unique
    seen: set[str] = set()
    for index, prompt_id in enumerate(frame["prompt_id"].astype(str).tolist()):
        if index in skip:
            continue
        if not prompt_id.strip():
            problems.setdefault("empty_id", []).append(index)
        elif prompt_id in seen:  # the first row with an id keeps it
            problems.setdefault("duplicate_id", []).append(index)
        else:
            seen.add(prompt_id)
    return problems


def _flagged(problems: dict[str, list[int]]) -> set[int]:
    return {index for rows in problems.values() for index in rows}


def _label(frame: pd.DataFrame, index: int, data: DataConfig) -> str:
    prompt_id = str(frame["prompt_id"].iat[index])
    if data.id_column and prompt_id.strip():
        return f"{prompt_id!r} (row {index})"
    return f"row {index}"


def _describe(
    problems: dict[str, list[int]], frame: pd.DataFrame, data: DataConfig, context: str | None,
    suggest_drop: bool = True, reasons: dict[int, str] | None = None,
) -> list[tuple[str, str]]:
    """One ConfigError problem per kind: the count, the first few rows (with what is wrong, for malformed
    messages), the fix."""
    out = []
    reasons = reasons or {}
    for kind, rows in problems.items():
        shown = ", ".join(_label(frame, i, data) + (f" ({reasons[i]})" if i in reasons else "")
                          for i in rows[:SHOWN]) + (", ..." if len(rows) > SHOWN else "")
        detail = f" ({context})" if kind == "too_long" and context else ""
        fix = {
            "too_long": "shorten or remove them, or lower rollout.max_new_tokens",
            "empty_id": f"give every row an id in column {data.id_column!r}",
            "duplicate_id": f"make the ids in column {data.id_column!r} unique",
        }.get(kind, f"fix or remove them (column {data.prompt_column!r})")
        drop = ", or set data.invalid_prompts: drop to skip them" if suggest_drop else ""
        message = (f"{len(rows)} of {len(frame)} rows {KIND_TEXT[kind]}{detail}: {shown} "
                   f"(rows count from 0, header excluded); {fix}{drop}")
        out.append(("data.path", message))
    return out


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
    """Check every prompt row; return the rows kept and a report of the rows dropped.

    Prompts are rendered as Generate renders them (operators/common/prompts.py; `prompt_options`: the
    PromptFormat fields, default `cfg.prompt_options()`), so lengths count the chat template too.
    A format that cannot render the prompts (chat messages or a system prompt without a chat template)
    is an error whatever `invalid_prompts` says.

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
    from operators.common.prompts import PromptFormat, PromptError, PromptRenderer

    data = cfg.data
    frame = prompts.reset_index(drop=True)
    if frame.empty:
        raise ConfigError([("data.path", f"{data.path!r} holds no prompts (0 rows); give a dataset with at least "
                            "one row")],
                          data.path)
    problems, reasons = _prompt_problems(frame)
    try:
        renderer = PromptRenderer(load_tokenizer(model_path, cfg.model.trust_remote_code),
                                  PromptFormat(**(prompt_options or cfg.prompt_options())))
    except PromptError as err:  # a template file that does not exist
        raise ConfigError([("data.chat_template", str(err))], data.path) from None
    format_problems = _format_problems(frame, renderer, _flagged(problems))
    if format_problems:
        raise ConfigError(format_problems + _describe(problems, frame, data, None, reasons=reasons), data.path)
    candidates = [i for i in range(len(frame)) if i not in _flagged(problems)]
    limit, source = model_context_length(cfg, model_path)
    context = None
    if limit is not None and candidates:
        texts = frame["prompt"].tolist()
        counts = prompt_token_counts([texts[i] for i in candidates], renderer)
        # multi-turn: an episode's turns and observations share one budget after the prompt
        env = cfg.rollout.environment
        field, after = (("rollout.environment.max_episode_tokens", env.max_episode_tokens) if env is not None
                        else ("rollout.max_new_tokens", cfg.rollout.max_new_tokens))
        budget = limit - after
        too_long = [i for i, count in zip(candidates, counts) if count > budget]
        if too_long:
            problems["too_long"] = too_long
            templated = " (chat template applied)" if renderer.uses_template(texts[too_long[0]]) else ""
            context = (f"prompt tokens{templated} + {field}={after} must be at most "
                       f"{limit}, from {source}; the longest prompt has {int(counts.max())} tokens")
    problems |= _id_problems(frame, data, _flagged(problems))
    if not problems:
        return frame, {}
    source_name = data.path
    if data.invalid_prompts == "error":
        raise ConfigError(_describe(problems, frame, data, context, reasons=reasons), source_name)
    dropped = sorted(_flagged(problems))
    if len(dropped) == len(frame):
        described = _describe(problems, frame, data, context, suggest_drop=False, reasons=reasons)
        raise ConfigError(
            [("data.invalid_prompts", f"all {len(frame)} prompts are invalid, so none is left to train on")]
            + described, source_name,
        )
    ids = frame["prompt_id"].astype(str).tolist()
    report = {kind: [ids[i] or f"row {i}" for i in rows] for kind, rows in problems.items()}
    kept = frame.drop(index=dropped).reset_index(drop=True)
    return kept, report
