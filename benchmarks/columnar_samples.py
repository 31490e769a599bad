"""A train step's samples on the CPU side, as numpy columns against the Python lists they replaced.

    python benchmarks/columnar_samples.py [--samples 512] [--n 8] [--max-response 1024] [--world 4]
                                          [--budget 8192] [--repeats 5] [--json PATH]

No model, no Ray: the work the Train operator and the ranks do on a step's samples before and after the
model, timed stage by stage, for the step's groups as a Ray Data pandas batch hands them over (numpy
arrays in object cells), `--samples` responses in groups of `--n`, response lengths long-tailed
(lognormal, median ~150 tokens, capped at `--max-response`), prompts of 64-256 tokens, token versions
and behaviour log-probs on every token:

  explode      the groups -> samples (operators.algorithms.step_batch.explode)
  shard        samples -> `--world` rank shards by tokens (shard)
  pickle       each shard pickled and unpickled, protocol 5 in-band (what travels to a rank; Ray sends
               numpy buffers out of band, so the columnar figure is an upper bound there)
  token_batch  each rank's shard cut into packed micro-batches of `--budget` tokens and each made into its
               padded tensors + packed rows (micro_batch_chunks, subset, token_batch), all ranks in turn
  rollouts     the step's rollouts table and its Parquet bytes (rollouts_table, to_parquet)

`columnar` is the code in operators/; `lists` is the list path it replaced (main before columnar
samples), reconstructed below. Each stage: the median of `--repeats` runs after one warm-up, in
seconds, and the ratio lists / columnar. Also printed: the pickled bytes per step. Run it alone on a
quiet machine: it measures one CPU core's work.
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd

from operators.algorithms.batching import (
    TOKEN_COLUMNS,
    TokenBatch,
    balanced_shards,
    packed_inputs,
    token_batch,
)
from operators.algorithms.step_batch import explode, micro_batch_chunks, shard, subset
from operators.stages.tables import ROLLOUT_COLUMNS, rollouts_table

STAGES = ("explode", "shard", "pickle", "token_batch", "rollouts")


def step_rows(samples: int, n: int, max_response: int, seed: int = 0) -> list[dict]:
    """One step's groups as the Train operator takes them in (`batch.to_dict("records")` of a pandas batch)."""
    rng = np.random.default_rng(seed)
    rows = []
    for group in range(samples // n):
        lengths = np.clip(rng.lognormal(np.log(150), 1.0, size=n).astype(int), 1, max_response)
        responses = np.empty(n, dtype=object)
        responses[:] = [rng.integers(3, 50_000, size=length, dtype=np.int64) for length in lengths]
        logprobs, versions = np.empty(n, dtype=object), np.empty(n, dtype=object)
        logprobs[:] = [-rng.random(length) for length in lengths]
        versions[:] = [np.full(length, 6, dtype=np.int64) for length in lengths]
        rows.append({
            "prompt_id": f"p{group}", "group_uid": f"s6-g{group}", "epoch": 0, "policy_version": 6,
            "policy_version_max": 6, "train_step": 7, "staleness": 1, "prompt": f"question {group}",
            "prompt_text": f"question {group}", "responses": np.array(["answer"] * n, dtype=object),
            "prompt_token_ids": rng.integers(3, 50_000, size=int(rng.integers(64, 257)), dtype=np.int64),
            "response_token_ids": responses, "response_lengths": lengths.astype(np.int64),
            "token_policy_versions": versions, "behavior_logprobs": logprobs,
            "rewards": rng.random(n), "advantages": rng.normal(size=n), "reward_errors": 0, "reward_timeouts": 0,
            "generator_id": "host:1",
        })
    return rows


# ------------------------------------------------------------------ the list path, as it was


def lists_response_staleness(row: dict, index: int) -> int:
    staleness = int(row.get("staleness", 0))
    versions = row.get("token_policy_versions")
    if versions is None or "policy_version" not in row or not len(versions[index]):
        return staleness
    return staleness + int(row["policy_version"]) - int(min(versions[index]))


def lists_explode(rows: list[dict]) -> dict[str, list]:
    samples = defaultdict(list)
    with_ref = any(row.get("ref_logprobs") is not None for row in rows)
    with_masks = any(row.get("loss_masks") is not None for row in rows)
    with_returns = all(row.get("returns") is not None for row in rows)
    for row in rows:
        for index, response in enumerate(row["response_token_ids"]):
            samples["prompt_token_ids"].append(list(row["prompt_token_ids"]))
            samples["response_token_ids"].append(list(response))
            samples["behavior_logprobs"].append(list(row["behavior_logprobs"][index]))
            advantage = row["advantages"][index]
            samples["advantages"].append(float(advantage) if np.ndim(advantage) == 0 else
                                         [float(value) for value in advantage])
            samples["staleness"].append(lists_response_staleness(row, index))
            if with_masks:
                masks = row.get("loss_masks")
                samples["loss_masks"].append(None if masks is None else [int(m) for m in masks[index]])
            if with_ref:
                refs = row.get("ref_logprobs")
                samples["ref_logprobs"].append(None if refs is None else [float(v) for v in refs[index]])
            if with_returns:
                samples["returns"].append([float(v) for v in row["returns"][index]])
                samples["old_values"].append([float(v) for v in row["values"][index]])
                samples["critic_version"].append(int(row.get("critic_version", -1)))
    return dict(samples)


def lists_shard(samples: dict, world_size: int) -> list[dict]:
    lengths = [len(p) + len(r) for p, r in zip(samples["prompt_token_ids"], samples["response_token_ids"])]
    return [{key: [values[i] for i in indices] for key, values in samples.items()}
            for indices in balanced_shards(lengths, world_size)]


def lists_subset(samples: dict, indices: list[int]) -> dict:
    return {key: [values[i] for i in indices] if values is not None else None for key, values in samples.items()}


def lists_token_batch(samples: dict, pad_id: int, required: tuple, optional: tuple = (), packed: bool = False
                      ) -> TokenBatch:
    import torch

    prompts, responses = samples["prompt_token_ids"], samples["response_token_ids"]
    sequences = [list(p) + list(r) for p, r in zip(prompts, responses)]
    rows, width = len(sequences), max(len(seq) for seq in sequences)
    columns = list(required) + [name for name in optional
                                if samples.get(name) is not None and all(v is not None for v in samples[name])]
    assert all(name in TOKEN_COLUMNS for name in columns)
    per_token = {name: torch.zeros((rows, width - 1)) for name in columns}
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    mask = torch.zeros((rows, width - 1))
    loss_masks = samples.get("loss_masks")
    if loss_masks is not None and all(m is None for m in loss_masks):
        loss_masks = None
    spans = torch.zeros((rows, width - 1)) if loss_masks is not None else None
    for row, seq in enumerate(sequences):
        prompt_len, response_len = len(prompts[row]), len(responses[row])
        input_ids[row, : len(seq)] = torch.tensor(seq)
        attention[row, : len(seq)] = 1
        span = slice(prompt_len - 1, prompt_len - 1 + response_len)
        mask[row, span] = 1.0
        if spans is not None:
            spans[row, span] = 1.0
            if loss_masks[row] is not None:
                mask[row, span] = torch.tensor([float(m) for m in loss_masks[row]])
        for name in columns:
            with np.errstate(over="ignore"):
                values = np.asarray(samples[name][row], dtype=np.float64).astype(np.float32)
            per_token[name][row, span] = torch.from_numpy(values) if values.ndim else float(values)
    staleness = samples.get("staleness")
    staleness = torch.tensor([int(s) for s in (staleness if staleness is not None else [0] * rows)])
    return TokenBatch(input_ids=input_ids, attention=attention, mask=mask, staleness=staleness, span=spans,
                      packed=packed_inputs(sequences, pad_id) if packed else None, **per_token)


def lists_rollouts(rows: list[dict], step: int) -> bytes:
    table = pd.DataFrame(rows)
    table["dropped"] = [None] * len(table)
    table["used"] = table["dropped"].isna()
    table["train_step"] = step
    table["staleness"] = step - table["policy_version"].astype(int)
    for column in ROLLOUT_COLUMNS:
        if column not in table.columns:
            table[column] = None
    for column in ("responses", "response_lengths", "rewards", "advantages"):
        table[column] = table[column].map(list)
    table["response_token_ids"] = table["response_token_ids"].map(
        lambda cell: None if cell is None else [[int(t) for t in response] for response in cell])
    table["token_policy_versions"] = table["token_policy_versions"].map(
        lambda cell: [[int(v) for v in response] for response in cell])
    buffer = io.BytesIO()
    table[ROLLOUT_COLUMNS].to_parquet(buffer, index=False)
    return buffer.getvalue()


# ------------------------------------------------------------------ the timed step

def run_step(rows: list[dict], world: int, budget: int, columnar: bool) -> tuple[dict[str, float], int]:
    """One step's stages, seconds each, and the pickled bytes of all shards."""
    seconds, clock = {}, time.perf_counter
    start = clock()
    samples = explode(rows) if columnar else lists_explode(rows)
    seconds["explode"] = clock() - start
    start = clock()
    shards = shard(samples, world) if columnar else lists_shard(samples, world)
    seconds["shard"] = clock() - start
    start = clock()
    payloads = [pickle.dumps(part, protocol=5) for part in shards]
    received = [pickle.loads(payload) for payload in payloads]
    seconds["pickle"] = clock() - start
    start = clock()
    cut = subset if columnar else lists_subset
    make = token_batch if columnar else lists_token_batch
    for part in received:
        for indices in micro_batch_chunks(part, budget, packed=True):
            make(cut(part, indices), 0, ("behavior_logprobs", "advantages"), ("ref_logprobs",), packed=True)
    seconds["token_batch"] = clock() - start
    start = clock()
    if columnar:
        rollouts_table(rows, 7, {}, samples).to_parquet()
    else:
        lists_rollouts(rows, 7)
    seconds["rollouts"] = clock() - start
    return seconds, sum(len(payload) for payload in payloads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=512, help="responses per step")
    parser.add_argument("--n", type=int, default=8, help="responses per group")
    parser.add_argument("--max-response", type=int, default=1024, help="the cap on a response's tokens")
    parser.add_argument("--world", type=int, default=4, help="policy ranks")
    parser.add_argument("--budget", type=int, default=8192, help="train.micro_batch_tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    rows = step_rows(args.samples, args.n, args.max_response)
    lengths = np.concatenate([row["response_lengths"] for row in rows])
    prompts = np.array([len(row["prompt_token_ids"]) for row in rows])
    print(f"{len(lengths)} samples in {len(rows)} groups; response tokens p50 {np.median(lengths):.0f} "
          f"p90 {np.percentile(lengths, 90):.0f} max {lengths.max()} (sum {lengths.sum()}); prompts "
          f"{prompts.min()}-{prompts.max()} tokens; {args.world} ranks; micro-batches of {args.budget} tokens; "
          f"median of {args.repeats} after a warm-up")
    results = {}
    for name, columnar in (("lists", False), ("columnar", True)):
        run_step(rows, args.world, args.budget, columnar)  # warm-up
        runs = [run_step(rows, args.world, args.budget, columnar) for _ in range(args.repeats)]
        stages = {stage: statistics.median(run[0][stage] for run in runs) for stage in STAGES}
        results[name] = {**stages, "total": sum(stages.values()), "pickled_bytes": runs[0][1]}
    print(f"\n{'stage':<12} {'lists s':>9} {'columnar s':>11} {'lists/columnar':>15}")
    for stage in (*STAGES, "total"):
        old, new = results["lists"][stage], results["columnar"][stage]
        print(f"{stage:<12} {old:>9.4f} {new:>11.4f} {old / max(new, 1e-12):>14.1f}x")
    print(f"{'pickled MB':<12} {results['lists']['pickled_bytes'] / 2**20:>9.1f} "
          f"{results['columnar']['pickled_bytes'] / 2**20:>11.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    from benchmarks.command_line import run_command

    sys.exit(run_command(main))
