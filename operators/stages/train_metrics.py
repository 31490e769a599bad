"""The Train operator's step metrics, one family per function: rewards and episodes (`reward_metrics`),
the policy ranks' figures merged (`rank_metrics`), the critic's (`critic_metrics`), time (`timing_metrics`),
dynamic sampling (`dynamic_sampling_metrics`), and the step's busy intervals for overlap analysis
(`step_timeline`). Pure functions of the step's rows, table and rank results.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from operators.algorithms.eval_metrics import answered_metrics
from operators.algorithms.step_batch import is_informative

STAGES = ("generate", "weight_sync", "reward", "advantage")
# Wall-clock stamps a group collects on its way to a train step (Generate's, Reward's with timestamps=True, and
# when this operator received it), kept per step in the `timeline` for benchmarks/loop_latency.py.
STAMPS = ("generate_start", "generate_end", "reward_start", "reward_end", "train_arrive")


def generate_intervals(rows: list[dict]) -> list[tuple[str, float, float]]:
    """Distinct generate calls that produced these rows: (generator id, start, end)."""
    calls = {
        (row["generator_id"], float(row["generate_start"]), float(row["generate_end"]))
        for row in rows if row.get("generate_start") is not None
    }
    return sorted(calls, key=lambda call: call[1])


def stamps(rows: list[dict]) -> dict[str, list]:
    """Per stamp, its value for each group of the step (None where a row lacks it)."""
    def value(row: dict, name: str) -> float | None:
        stamp = row.get(name)
        return None if stamp is None or pd.isna(stamp) else float(stamp)

    return {name: [value(row, name) for row in rows] for name in STAMPS}


def reward_metrics(table: pd.DataFrame, success_threshold: float) -> dict:
    rewards = np.concatenate([np.asarray(r, dtype=float) for r in table["rewards"]])
    lengths = np.concatenate([np.asarray(l, dtype=float) for l in table["response_lengths"]])
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "success_rate": float((rewards >= success_threshold).mean()),
        "response_length_mean": float(lengths.mean()),
        "generated_tokens": int(lengths.sum()),
        "reward_errors": int(table["reward_errors"].sum()),
        "reward_timeouts": int(table["reward_timeouts"].sum()),
        "staleness_mean": float(table["staleness"].mean()),
        "staleness_max": int(table["staleness"].max()),
        "num_groups": len(table),
        **answered_metrics(table, success_threshold),
        **episode_metrics(table),
    }


def episode_metrics(table: pd.DataFrame) -> dict:
    """Multi-turn steps: turns per episode, tool calls and their errors, environment errors, and the
    share of the response tokens that are the policy's (the rest are observations, not trained)."""
    if "num_turns" not in table.columns:
        return {}
    turns = np.concatenate([np.asarray(t, dtype=float) for t in table["num_turns"]])
    tokens = sum(sum(lengths) for lengths in table["response_lengths"])
    policy = sum(int(np.sum(mask)) for masks in table["loss_masks"] for mask in masks) if "loss_masks" in table else 0
    ends = [end for cell in table["episode_ends"] for end in cell]
    return {
        "turns_mean": float(turns.mean()),
        "tool_calls": int(table["tool_calls"].sum()),
        "tool_errors": int(table["tool_errors"].sum()),
        "env_errors": int(table["env_errors"].sum()),
        "policy_token_share": float(policy / tokens) if tokens else 1.0,
        "episodes_cut": sum(end in ("max_turns", "token_budget") for end in ends),  # by a limit, not by the model
    }


# Per-rank figures merged by hand in rank_metrics; every other float is a token-weighted loss statistic.
_RANK_SPECIAL = {"num_tokens", "policy_loss", "grad_norm", "grad_norm_last", "train_seconds", "publish_seconds",
                 "nonfinite_skipped", "mismatch", "micro_batches", "optimizer_steps", "empty_updates"}


def rank_metrics(results: list[dict]) -> dict:
    """Merge the ranks' figures: token-weighted means of the loss statistics (*_max: maximum,
    *_min: minimum), the mismatch statistics from their sums (operators.algorithms.correction.merge_mismatch),
    the mean loss, rank 0's gradient norms (global after DeepSpeed's all-reduce), the slowest time."""
    from operators.algorithms.correction import merge_mismatch  # torch: imported only where a step is trained

    tokens = np.array([r["num_tokens"] for r in results], dtype=float)
    weights = tokens / max(tokens.sum(), 1.0)
    merged = {}
    for key in [key for key in results[0] if key not in _RANK_SPECIAL]:
        values = [float(r[key]) for r in results]
        if key.endswith("_max"):
            merged[key] = max(values)
        elif key.endswith("_min"):
            merged[key] = min(values)
        else:
            merged[key] = float(sum(w * v for w, v in zip(weights, values)))
    merged.update(merge_mismatch([part for r in results for part in r["mismatch"]]))
    merged["policy_loss"] = float(np.mean([r["policy_loss"] for r in results]))
    merged["grad_norm"] = float(results[0]["grad_norm"])
    merged["grad_norm_last"] = float(results[0]["grad_norm_last"])
    merged["optimizer_steps"] = int(results[0]["optimizer_steps"])
    merged["empty_updates"] = int(results[0].get("empty_updates", 0))  # the ranks skip together
    merged["time_train"] = float(max(r["train_seconds"] for r in results))
    merged["time_publish"] = float(results[0]["publish_seconds"])
    merged["nonfinite_skipped"] = int(max(r.get("nonfinite_skipped", 0) for r in results))
    return merged


def critic_metrics(results: list[dict], rows: list[dict]) -> dict:
    """The critic's step: its ranks' loss statistics (token-weighted), and over every response token of
    the step the values it was trained from, the return targets and how much of their variance the
    values explain (1 - Var(R - V) / Var(R): 1 is perfect, 0 no better than a constant)."""
    tokens = np.array([r["num_tokens"] for r in results], dtype=float)
    weights = tokens / max(tokens.sum(), 1.0)
    values = np.concatenate([np.asarray(v, dtype=float) for row in rows for v in row["values"]] or [np.zeros(0)])
    returns = np.concatenate([np.asarray(v, dtype=float) for row in rows for v in row["returns"]] or [np.zeros(0)])
    variance = returns.var() if returns.size else 0.0
    return {
        **{key: float(sum(w * r[key] for w, r in zip(weights, results)))
           for key in ("value_loss", "value_clip_fraction") if key in results[0]},
        "explained_variance": float(1.0 - (returns - values).var() / variance) if variance > 0 else float("nan"),
        "value_mean": float(values.mean()) if values.size else float("nan"),
        "return_mean": float(returns.mean()) if returns.size else float("nan"),
        "critic_version": int(min(int(row["critic_version"]) for row in rows)),  # the oldest critic of the step
        "critic_grad_norm": float(results[0]["grad_norm"]),
        "critic_nonfinite_skipped": int(max(r["nonfinite_skipped"] for r in results)),
        # samples whose V_old the critic recomputed: the Value stage's critic was older than the trained one
        "critic_stale_values": int(sum(r.get("stale_values_refreshed", 0) for r in results)),
        "time_value": float(sum(row.get("time_value", 0.0) for row in rows)),
        "time_critic": float(max(r["train_seconds"] for r in results)),
        "time_critic_publish": float(results[0]["publish_seconds"]),
    }


def timing_metrics(rows: list[dict], waited: float, start: float, end: float) -> dict:
    timings = {f"time_{stage}": float(sum(row.get(f"time_{stage}", 0.0) for row in rows)) for stage in STAGES}
    tokens = sum(sum(row["response_lengths"]) for row in rows)
    step_wall = waited + (end - start)
    return {**timings, "time_wait": waited, "step_seconds": step_wall, "tokens_per_s": tokens / max(step_wall, 1e-9)}


def dynamic_sampling_metrics(rows: list[dict], dropped: dict[str, str]) -> dict:
    """DAPO dynamic sampling's step: the groups left out for zero variance and as surplus, and the
    zero-variance ones the step was topped up with (`rows`: the groups trained)."""
    return {"dynamic_sampling_zero_variance": sum(r == "zero_variance" for r in dropped.values()),
            "dynamic_sampling_surplus": sum(r == "surplus" for r in dropped.values()),
            "dynamic_sampling_topped_up": sum(not is_informative(row) for row in rows)}


def step_timeline(wall_start: float, seconds: float, rows: list[dict], generated: list[dict]) -> str:
    """Busy intervals (wall clock) of a step's work, for overlap analysis (pipelines/tracking/timeline.py):
    the training, the generate calls of its `rows`, and the stamps of every `generated` group; a JSON string
    so it travels as a plain Arrow column and is not logged as a metric."""
    return json.dumps({"train": (wall_start, wall_start + seconds), "generate": generate_intervals(rows),
                       "stamps": stamps(generated)})
