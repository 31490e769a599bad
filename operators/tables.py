"""The Train operator's step table: a step's groups as the rollouts Parquet and the ledger hold them
(`rollouts_table`), and a table as Parquet bytes (`to_parquet`, also used by in-training evaluation).
"""

from __future__ import annotations

import io

import pandas as pd

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
# Multi-turn episodes (operators/environment.py): each episode's turns (JSON: text, tool_call, observation,
# reward, error, ended_by, tokens, version), turn count, what ended it, the environment's reward, and per
# response token 1 (the policy's) or 0 (an observation's).
EPISODE_COLUMNS = ["loss_masks", "turns", "num_turns", "episode_ends", "env_rewards", "tool_calls", "tool_errors", "env_errors"]
# With a critic: the version that valued the group, and per response token its values and return targets.
CRITIC_COLUMNS = ["critic_version", "values", "returns"]


def rollouts_table(rows: list[dict], step: int, dropped: dict[str, str] | None = None) -> pd.DataFrame:
    """The step's groups as the rollouts Parquet and the ledger hold them; `dropped`: group_uid ->
    why dynamic sampling left it out of the update (the others are `used`)."""
    dropped = dropped or {}
    table = pd.DataFrame(rows)
    table["dropped"] = [dropped.get(str(uid)) for uid in table.get("group_uid", [None] * len(table))]
    table["used"] = table["dropped"].isna()
    table["train_step"] = step
    table["staleness"] = step - table["policy_version"].astype(int)
    if "policy_version_max" not in table.columns:  # one version per group (call-synchronous engines)
        table["policy_version_max"] = table["policy_version"]
    if "token_policy_versions" not in table.columns:
        table["token_policy_versions"] = [[[int(version)] * int(length) for length in lengths] for version, lengths
                                          in zip(table["policy_version"], table["response_lengths"])]
    for column in ROLLOUT_COLUMNS:
        if column not in table.columns:
            table[column] = None
    for column in ("responses", "response_lengths", "rewards", "advantages"):
        table[column] = table[column].map(list)
    # chat messages arrive as numpy arrays of dicts (Arrow list<struct> in a pandas batch)
    table["prompt"] = table["prompt"].map(lambda cell: cell.tolist() if hasattr(cell, "tolist") else cell)
    table["response_token_ids"] = table["response_token_ids"].map(
        lambda cell: None if cell is None else [[int(t) for t in response] for response in cell])
    table["token_policy_versions"] = table["token_policy_versions"].map(
        lambda cell: [[int(v) for v in response] for response in cell])
    critic = [column for column in CRITIC_COLUMNS if column in table.columns]
    for column in set(critic) - {"critic_version"}:
        table[column] = table[column].map(lambda cell: [[float(v) for v in response] for response in cell])
    episodes = [column for column in EPISODE_COLUMNS if column in table.columns]
    for column in set(episodes) & {"turns", "num_turns", "episode_ends", "env_rewards"}:
        table[column] = table[column].map(list)
    if "loss_masks" in episodes:
        table["loss_masks"] = table["loss_masks"].map(lambda cell: [[int(m) for m in mask] for mask in cell])
    return table[ROLLOUT_COLUMNS + critic + episodes]


def to_parquet(table: pd.DataFrame) -> bytes:
    """The table as Parquet bytes (no index)."""
    buffer = io.BytesIO()
    table.to_parquet(buffer, index=False)
    return buffer.getvalue()
