"""The Train operator's step table: a step's groups as the rollouts Parquet and the ledger hold them
(`rollouts_table`), and a table as Parquet bytes (`to_parquet`, also used by in-training evaluation).

The per-token columns (token ids, token versions, per-token advantages, values, returns, loss masks) are
written from the step's sample arrays (operators.algorithms.step_batch.explode, what the ranks train on):
Arrow list arrays over their offsets, so no token passes through Python on the way to the file.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from operators.algorithms.columns import Ragged
from operators.algorithms.step_batch import explode

# `policy_version` is the oldest version that sampled a token of the group (what staleness counts),
# `policy_version_max` the newest: they differ only under partial rollout, where `token_policy_versions`
# gives the version of every response token; `generator_id` the generate actor (host:pid) that sampled it.
# `prompt_text` is the prompt as the model read it (chat template applied); `response_token_ids` the sampled
# tokens, the stop token included.
ROLLOUT_COLUMNS = [
    "prompt_id", "group_uid", "epoch", "policy_version", "policy_version_max", "train_step", "staleness", "prompt",
    "prompt_text", "responses", "response_token_ids", "response_lengths", "token_policy_versions", "rewards", "advantages", "reward_errors",
    "reward_timeouts", "used", "dropped", "generator_id",
]
# Multi-turn episodes (operators/environments/environment.py): each episode's turns (JSON: text, tool_call, observation,
# reward, error, ended_by, tokens, version), turn count, what ended it, the environment's reward, and per
# response token 1 (the policy's) or 0 (an observation's).
EPISODE_COLUMNS = ["loss_masks", "turns", "num_turns", "episode_ends", "env_rewards", "tool_calls", "tool_errors", "env_errors"]
# With a critic: the version that valued the group, and per response token its values and return targets.
CRITIC_COLUMNS = ["critic_version", "values", "returns"]
# Columns with one entry per response (a list per group) that the step's samples carry, and their name there.
SAMPLE_COLUMNS = {"response_token_ids": "response_token_ids", "advantages": "advantages", "values": "old_values",
                  "returns": "returns", "loss_masks": "loss_masks"}
DTYPES = {"response_token_ids": np.int64, "token_policy_versions": np.int64, "advantages": np.float64,
          "values": np.float64, "returns": np.float64, "loss_masks": np.int64}


@dataclass
class StepRollouts:
    """A step's groups, one row each in `groups` (what the ledger and the step's metrics read, per-token
    columns included as numpy views), and the per-token columns again as Arrow arrays in `tokens` (one
    list per response, one list of them per group), which the Parquet is written from."""

    groups: pd.DataFrame
    tokens: dict[str, pa.Array]

    def to_parquet(self) -> bytes:
        """The rollouts as Parquet bytes: the file pandas writes for `groups` (columns, types, values, pandas
        metadata), with the per-token columns taken from the Arrow arrays instead of converted cell by cell."""
        table = pa.Table.from_pandas(self.groups.assign(**{name: None for name in self.tokens}), preserve_index=False)
        meta = json.loads(table.schema.metadata[b"pandas"])
        for entry in meta["columns"]:
            if entry["name"] in self.tokens:  # what pandas would have named the list column's type
                entry["pandas_type"] = _pandas_type(self.tokens[entry["name"]].type)
        for name, array in self.tokens.items():
            table = table.set_column(table.schema.get_field_index(name), pa.field(name, array.type), array)
        table = table.replace_schema_metadata({**table.schema.metadata, b"pandas": json.dumps(meta).encode()})
        buffer = io.BytesIO()
        pq.write_table(table, buffer, compression="snappy")  # pandas' defaults
        return buffer.getvalue()


def rollouts_table(rows: list[dict], step: int, dropped: dict[str, str] | None = None,
                   samples: dict | None = None) -> StepRollouts:
    """The step's groups as the rollouts Parquet and the ledger hold them; `dropped`: group_uid ->
    why dynamic sampling left it out of the update (the others are `used`). `samples`: explode(rows),
    when the caller has it already (the Train operator: the same arrays the ranks get)."""
    samples = explode(rows) if samples is None else samples
    dropped = dropped or {}
    table = pd.DataFrame(rows)
    table["dropped"] = [dropped.get(str(uid)) for uid in table.get("group_uid", [None] * len(table))]
    table["used"] = table["dropped"].isna()
    table["train_step"] = step
    table["staleness"] = step - table["policy_version"].astype(int)
    if "policy_version_max" not in table.columns:  # one version per group (call-synchronous engines)
        table["policy_version_max"] = table["policy_version"]
    for column in ROLLOUT_COLUMNS:
        if column not in table.columns:
            table[column] = None
    for column in ("responses", "response_lengths", "rewards"):
        table[column] = table[column].map(list)
    # chat messages arrive as numpy arrays of dicts (Arrow list<struct> in a pandas batch)
    table["prompt"] = table["prompt"].map(lambda cell: cell.tolist() if hasattr(cell, "tolist") else cell)
    critic = [column for column in CRITIC_COLUMNS if column in table.columns]
    episodes = [column for column in EPISODE_COLUMNS if column in table.columns]
    for column in set(episodes) & {"turns", "num_turns", "episode_ends", "env_rewards"}:
        table[column] = table[column].map(list)
    sizes = np.array([len(row["response_token_ids"]) for row in rows], dtype=np.int64)
    tokens = {}
    for name in [column for column in ROLLOUT_COLUMNS + critic + episodes if column in DTYPES]:
        if name == "token_policy_versions":
            column = _token_versions(rows, sizes)
        elif samples.get(SAMPLE_COLUMNS[name]) is not None:
            column = samples[SAMPLE_COLUMNS[name]]
        else:  # a column the samples do not carry (values without returns, say): from the rows
            column = Ragged.from_rows(_responses(rows, sizes, name), DTYPES[name])
        tokens[name] = _grouped(column, sizes)
        table[name] = pd.Series(_per_group(column, sizes), index=table.index, dtype=object)  # a list per cell
    return StepRollouts(table[ROLLOUT_COLUMNS + critic + episodes], tokens)


def to_parquet(table: pd.DataFrame) -> bytes:
    """The table as Parquet bytes (no index)."""
    buffer = io.BytesIO()
    table.to_parquet(buffer, index=False)
    return buffer.getvalue()


def _responses(rows: list[dict], sizes: np.ndarray, name: str) -> list:
    """Column `name` of each row's responses, one entry per response (None for a row without it)."""
    return [None if row.get(name) is None else row[name][index] for row, size in zip(rows, sizes)
            for index in range(size)]


def _token_versions(rows: list[dict], sizes: np.ndarray) -> Ragged:
    """The policy version that sampled each response token: the row's `token_policy_versions`, or (one
    version per group) its `policy_version` on each of its `response_lengths` tokens."""
    entries = []
    for row, size in zip(rows, sizes):
        versions = row.get("token_policy_versions")
        entries += [np.full(int(row["response_lengths"][index]), int(row["policy_version"]), dtype=np.int64)
                    if versions is None else versions[index] for index in range(size)]
    return Ragged.from_rows(entries, np.int64)


def _group_bounds(sizes: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def _null_groups(column, sizes: np.ndarray) -> np.ndarray | None:
    """[G] bool: the groups whose every response lacks the column (a row without it), or None for none."""
    if not isinstance(column, Ragged) or column.missing is None:
        return None
    missing = np.concatenate([[0], np.cumsum(column.missing)])
    bounds = _group_bounds(sizes)
    return (missing[bounds[1:]] - missing[bounds[:-1]] == sizes) & (sizes > 0)


def _grouped(column, sizes: np.ndarray) -> pa.Array:
    """A column of the step's responses (a 1-D array: a number per response; Ragged: a list per response)
    as one Arrow list per group of `sizes` responses; null for a group without the column."""
    if isinstance(column, Ragged):
        missing = pa.array(column.missing) if column.missing is not None else None
        inner = pa.ListArray.from_arrays(pa.array(column.offsets.astype(np.int32)), pa.array(column.values),
                                         mask=missing)
    else:
        inner = pa.array(np.asarray(column))
    nulls = _null_groups(column, sizes)
    return pa.ListArray.from_arrays(pa.array(_group_bounds(sizes).astype(np.int32)), inner,
                                    mask=None if nulls is None else pa.array(nulls))


def _per_group(column, sizes: np.ndarray) -> list:
    """The column cut into one list per group (numpy views of its rows; None for a group without it)."""
    entries, nulls = list(column), _null_groups(column, sizes)
    bounds = _group_bounds(sizes)
    return [None if nulls is not None and nulls[group] else entries[start:end]
            for group, (start, end) in enumerate(zip(bounds[:-1], bounds[1:]))]


def _pandas_type(arrow_type: pa.DataType) -> str:
    """The name pandas' Parquet metadata gives an Arrow type (pyarrow's logical type names)."""
    if pa.types.is_list(arrow_type):
        return f"list[{_pandas_type(arrow_type.value_type)}]"
    return np.dtype(arrow_type.to_pandas_dtype()).name
