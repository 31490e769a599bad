"""How a train step's batch is made and cut: the step's groups become samples (`explode`, one per response),
the samples are dealt to the ranks (`shard`), and a rank cuts its shard into mini-batches (one per optimizer
step) and micro-batches (one per forward/backward). Also DAPO's dynamic sampling (`select_informative`), the
step's loss normalisers and the critic's share of the samples.

Pure functions on dicts of columns (numpy, operators/algorithms/columns.py; plain lists work too): the Train
operator (operators/stages/train.py) and the trainer ranks (operators/workers/train_worker.py) call them.
"""

from __future__ import annotations

import numpy as np

from operators.algorithms.batching import balanced_shards, trained_token_counts
from operators.algorithms.chunking import length_sorted_chunks, packed_chunks
from operators.algorithms.columns import Ragged, as_ragged, lengths, take
from operators.algorithms.shared_prompts import shared_chunks


def is_informative(row: dict) -> bool:
    """A group teaches something when its rewards differ (GRPO-style advantages are all 0 otherwise)."""
    return float(np.ptp(np.asarray(row["rewards"], dtype=float))) > 0


def select_informative(rows: list[dict], count: int) -> tuple[list[dict], dict[str, str]]:
    """DAPO dynamic sampling: the first `count` groups (in the given, schedule order) whose rewards
    differ; if fewer differ, topped up with the first zero-variance ones, so every step trains the
    same number of samples. Returns the rows kept and, per group_uid left out, why:
    "zero_variance" (no learning signal) or "surplus" (informative, but `count` were already kept)."""
    informative = [row for row in rows if is_informative(row)]
    flat = [row for row in rows if not is_informative(row)]
    kept = informative[:count] + flat[:max(0, count - len(informative))]
    kept_ids = {id(row) for row in kept}
    dropped = {str(row["group_uid"]): "surplus" if is_informative(row) else "zero_variance"
               for row in rows if id(row) not in kept_ids}
    order = {id(row): index for index, row in enumerate(rows)}
    return sorted(kept, key=lambda row: order[id(row)]), dropped


def explode(rows: list[dict]) -> dict:
    """Groups -> samples: one entry per response, in group order, in numpy columns
    (operators/algorithms/columns.py): token ids, log-probs and every other per-token column are Ragged
    (int64 ids and masks, float64 values), per-response values 1-D arrays.

    An advantage stays one per response (a float64 array) or becomes one per response token (Ragged, e.g.
    GAE; in a step that mixes the two a float is spread over its response's tokens, which trains the same).
    `staleness` (train_step - policy_version; 0 for a row without it) goes with every sample, and
    `ref_logprobs` (one per response token) when the rows carry that column (None for a row
    without it: the trainer refuses a KL term then); `loss_masks` likewise (None for a single-turn row in a
    multi-turn step: every token trained); `returns` and `old_values` (the Value stage's `values`), one per
    response token, and `critic_version` when the rows carry returns (for the critic)."""
    sizes = [len(row["response_token_ids"]) for row in rows]
    group = np.repeat(np.arange(len(rows)), sizes)  # [N]: each sample's row
    responses = _responses(rows, sizes, "response_token_ids")
    samples = {
        "prompt_token_ids": Ragged.from_rows([row["prompt_token_ids"] for row in rows], np.int64).take(group),
        "response_token_ids": Ragged.from_rows(responses, np.int64),
        "behavior_logprobs": Ragged.from_rows(_responses(rows, sizes, "behavior_logprobs"), np.float64),
        "advantages": _advantages(_responses(rows, sizes, "advantages"), responses),
        "staleness": np.array([response_staleness(row, index) for row, size in zip(rows, sizes)
                               for index in range(size)], dtype=np.int64),
    }
    if any(row.get("loss_masks") is not None for row in rows):  # multi-turn: observation tokens carry no loss
        samples["loss_masks"] = Ragged.from_rows(_responses(rows, sizes, "loss_masks"), np.int64)
    if any(row.get("ref_logprobs") is not None for row in rows):
        samples["ref_logprobs"] = Ragged.from_rows(_responses(rows, sizes, "ref_logprobs"), np.float64)
    if all(row.get("returns") is not None for row in rows):
        samples["returns"] = Ragged.from_rows(_responses(rows, sizes, "returns"), np.float64)
        samples["old_values"] = Ragged.from_rows(_responses(rows, sizes, "values"), np.float64)
        samples["critic_version"] = np.repeat(np.array([int(row.get("critic_version", -1)) for row in rows],
                                                       dtype=np.int64), sizes)
    return samples


def _responses(rows: list[dict], sizes: list[int], name: str) -> list:
    """Column `name` of each row's responses, one entry per response (None for a row without the column)."""
    return [None if row.get(name) is None else row[name][index] for row, size in zip(rows, sizes)
            for index in range(size)]


def _advantages(advantages: list, responses: list):
    """One float per response (float64 [N]) when every advantage is one, else one per response token (Ragged)."""
    if all(np.ndim(advantage) == 0 for advantage in advantages):
        return np.array(advantages, dtype=np.float64)
    return Ragged.from_rows([np.full(len(response), advantage, dtype=np.float64) if np.ndim(advantage) == 0
                             else advantage for advantage, response in zip(advantages, responses)], np.float64)


def split_critic_samples(samples: dict) -> dict:
    """Take the critic's columns out of the step's samples (`explode`'s) and return the critic's samples:
    the sequences, the return targets, the Value stage's values and critic versions, and the policy's loss
    masks: the critic is trained on the policy's tokens only (an observation is not a state the policy acts
    from), under the policy's normaliser. {} when the samples carry no returns."""
    critic = {key: samples.pop(key) for key in ("returns", "old_values", "critic_version") if key in samples}
    if not critic:
        return {}
    return {"prompt_token_ids": samples["prompt_token_ids"], "response_token_ids": samples["response_token_ids"],
            **critic, **({"loss_masks": samples["loss_masks"]} if "loss_masks" in samples else {})}


def step_normalisers(samples: dict) -> tuple[int, int]:
    """The step's loss normalisers over all ranks: its trained tokens, and its responses with at least one
    (an episode whose every token is an observation trains nothing and is not counted, as the ranks' own
    count for several mini-batches leaves it out: operators.workers.train_worker.TrainWorker._global_counts)."""
    counts = trained_token_counts(samples)
    return int(counts.sum()), int(np.count_nonzero(counts))


def token_masks(row: dict) -> list[list[int]]:
    """Per response of a group, 1 at each token the loss trains: its loss mask (multi-turn), else all 1s."""
    masks = row.get("loss_masks")
    if masks is not None:
        return [[int(m) for m in mask] for mask in masks]
    return [[1] * len(response) for response in row["response_token_ids"]]


def response_staleness(row: dict, index: int) -> int:
    """train_step - the oldest version that sampled a token of response `index` (partial rollout: the
    response's own tokens; otherwise the group's one version)."""
    staleness = int(row.get("staleness", 0))
    versions = row.get("token_policy_versions")
    if versions is None or "policy_version" not in row or not len(versions[index]):
        return staleness
    return staleness + int(row["policy_version"]) - int(np.min(versions[index]))


def sequence_lengths(samples: dict) -> list[int]:
    """Prompt + response tokens of each sample (what a rank computes on)."""
    return (lengths(samples["prompt_token_ids"]) + lengths(samples["response_token_ids"])).tolist()


def shard(samples: dict, world_size: int, equal_counts: bool = False) -> list[dict]:
    """The step's samples dealt to the ranks by tokens (prompt + response, what a rank computes on):
    token counts within one sample of each other; `equal_counts` (several mini-batches per rank) keeps
    the sample counts equal instead (operators.algorithms.batching.balanced_shards). Each column is cut with
    one gather (`subset`)."""
    return [subset(samples, indices) for indices in balanced_shards(sequence_lengths(samples), world_size, equal_counts)]


def subset(samples: dict, indices: list[int]) -> dict:
    """The samples at `indices`, in that order, each column of the kind it was (a column that is None stays None)."""
    return {key: take(values, indices) for key, values in samples.items()}


def mini_batch_parts(count: int, parts: int, seed: int, version: int, epoch: int) -> list[list[int]]:
    """A rank's sample indices per optimizer step of one epoch: `parts` equal parts of `count` samples
    (config validation makes them divide `count`). One part keeps the arrival order; several are cut from a
    permutation drawn from (seed, policy version, epoch), so every epoch mixes them differently and a resumed
    run draws the same ones."""
    order = np.arange(count)
    if parts > 1:
        order = np.random.default_rng([seed, version, epoch]).permutation(count)
    return [part.tolist() for part in np.array_split(order, parts)]


def micro_batch_chunks(samples: dict, budget: int, packed: bool = False, share_prompts: bool = False) -> list[list[int]]:
    """Sample indices per micro-batch on one rank. Packed: at most `budget` tokens in all, first-fit
    longest first (operators.algorithms.chunking.packed_chunks). Padded: sorted by length, cut so that
    no micro-batch pads to more than `budget` tokens (on long-tailed response lengths this removes most
    padding: short responses no longer pad to the longest one). Shared prompts: the same on units of a
    prompt and its responses, so a group stays in one micro-batch where it fits (shared_prompts.shared_chunks).
    Either way 0 means one batch, in arrival order. The ranks then even out their counts
    (operators.algorithms.batching.split_to_count)."""
    count = len(samples["response_token_ids"])
    if not budget:
        return [list(range(count))] if count else []
    if share_prompts:
        return shared_chunks(as_ragged(samples["prompt_token_ids"], np.int64), lengths(samples["response_token_ids"]),
                             budget)
    counts = sequence_lengths(samples)
    return packed_chunks(counts, budget) if packed else length_sorted_chunks(counts, budget)
