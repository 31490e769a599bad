"""Packing sequences of long-tailed lengths into padded batches (the trainer's micro-batches, the
reference model's chunks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def length_sorted_chunks(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices sorted by length, cut so that no chunk pads to more than `budget` tokens (chunk size x
    its longest sequence); a sequence longer than the budget gets a chunk of its own. On long-tailed
    lengths this removes most padding: short sequences no longer pad to the longest one."""
    chunks, current, width = [], [], 0
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        grown = max(width, lengths[index])
        if current and grown * (len(current) + 1) > budget:
            chunks.append(current)
            current, grown = [], lengths[index]
        current.append(index)
        width = grown
    return chunks + ([current] if current else [])


def split_to_count(chunks: list[list[int]], count: int) -> list[list[int]]:
    """`chunks` cut further until there are `count` of them: the largest is halved (its halves keep the
    order inside it, so length-sorted chunks stay sorted); once every chunk holds one index, empty
    chunks ([]) make up the rest. Ranks of a ZeRO-3 group use it to run the same number of passes."""
    chunks = [list(chunk) for chunk in chunks]
    while len(chunks) < count:
        largest = max(range(len(chunks)), key=lambda i: len(chunks[i]), default=None)
        if largest is None or len(chunks[largest]) <= 1:
            chunks.extend([] for _ in range(count - len(chunks)))
            break
        chunk = chunks[largest]
        chunks[largest:largest + 1] = [chunk[:len(chunk) // 2], chunk[len(chunk) // 2:]]
    return chunks


def balanced_shards(lengths: list[int], parts: int, equal_counts: bool = False) -> list[list[int]]:
    """Indices of `lengths` dealt to `parts` ranks so each rank gets about the same number of tokens
    (a rank's compute and memory follow its tokens, not its sample count). Each shard lists its indices
    in ascending order.

    Default: longest first, each to the rank with the fewest tokens so far (list scheduling), so the
    ranks' token counts differ by at most one sample's length, and every rank gets a sample when there
    are at least `parts`. `equal_counts`: every rank gets len / parts samples (callers that cut each
    rank's samples into equal mini-batches need it), dealt longest first in snake order (0..P-1, P-1..0,
    ...), which keeps token counts close without the bound above."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    shards: list[list[int]] = [[] for _ in range(parts)]
    if equal_counts:
        for position, index in enumerate(order):
            lap, offset = divmod(position, parts)
            shards[offset if lap % 2 == 0 else parts - 1 - offset].append(index)
    else:
        loads = [0] * parts
        for index in order:
            rank = min(range(parts), key=lambda r: (loads[r], len(shards[r]), r))
            shards[rank].append(index)
            loads[rank] += lengths[index]
    return [sorted(shard) for shard in shards]


# Per-response-token columns a TokenBatch can carry, in shifted (next-token) coordinates [B, L-1].
TOKEN_COLUMNS = ("behavior_logprobs", "advantages", "proximal_logprobs", "ref_logprobs", "returns", "old_values")


@dataclass
class TokenBatch:
    """One padded micro-batch of prompt + response sequences, as the trainer's losses read it.

    Sequences are right-padded to the longest, L tokens. Per-token columns sit in shifted (next-token)
    coordinates: position t holds the value for predicting token t + 1, so `mask` marks the positions
    whose next token is a response token. A column a sample set lacks is None. Shapes: B rows, L tokens.
    """

    input_ids: torch.Tensor  # [B, L] long: prompt + response, then pad_id
    attention: torch.Tensor  # [B, L] long: 1 on real tokens
    mask: torch.Tensor  # [B, L-1] float: 1 where a policy token of the response is predicted (trained)
    staleness: torch.Tensor  # [B] long: train step - policy version of the sample (0 when not given)
    # [B, L-1] float: 1 at every response token, an environment's observation tokens too (multi-turn
    # episodes, whose `loss_masks` leave those out of `mask`); None: the same as `mask`
    span: torch.Tensor | None = None
    behavior_logprobs: torch.Tensor | None = None  # [B, L-1]: the engine's log-probs (policy)
    advantages: torch.Tensor | None = None  # [B, L-1]: a response's advantage, or one per token (GAE)
    proximal_logprobs: torch.Tensor | None = None  # [B, L-1]: pi_prox, fixed before several updates
    ref_logprobs: torch.Tensor | None = None  # [B, L-1]: the reference model's (KL penalty)
    returns: torch.Tensor | None = None  # [B, L-1]: GAE return targets (critic)
    old_values: torch.Tensor | None = None  # [B, L-1]: the values the Value stage predicted (critic)

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    def require(self, *columns: str) -> tuple:
        """The named per-token columns, raising a clear error for one the samples did not carry."""
        missing = [name for name in columns if getattr(self, name) is None]
        if missing:
            raise ValueError(f"the batch has no {', '.join(missing)} column (one value per response, or one per "
                             "response token, on every sample)")
        return tuple(getattr(self, name) for name in columns)

    def at_response(self, values: torch.Tensor, row: int) -> torch.Tensor:
        """Row `row` of a [B, L-1] tensor at its response tokens only (observations included): [response length]."""
        span = self.mask if self.span is None else self.span
        return values[row][span[row].bool()]

    def to(self, device) -> TokenBatch:
        """Every tensor on `device` (copies issued non-blocking)."""
        return TokenBatch(**{name: None if value is None else value.to(device, non_blocking=True)
                             for name, value in vars(self).items()})


def trained_tokens(samples: dict, index: int) -> int:
    """Response tokens of sample `index` that the loss trains: all of them, or the policy's only when the
    samples carry `loss_masks` (multi-turn episodes: observation tokens are the environment's)."""
    masks = samples.get("loss_masks")
    if masks is not None and masks[index] is not None:
        return int(sum(masks[index]))
    return len(samples["response_token_ids"][index])


def token_batch(samples: dict, pad_id: int, required: tuple[str, ...], optional: tuple[str, ...] = (),
                device=None) -> TokenBatch:
    """A TokenBatch of `samples` (columns of equal length: prompt_token_ids, response_token_ids, and
    the per-token columns): the `required` TOKEN_COLUMNS, and each `optional` one when every sample
    carries it. A per-token value is one float per response (broadcast over its tokens) or one per
    response token; float32, overflowing to +-inf (the trainer's NaN guard then sees it) rather than
    raising. `loss_masks` (optional, one 0/1 per response token): only the 1s are in `mask`."""
    import numpy as np
    import torch

    prompts, responses = samples["prompt_token_ids"], samples["response_token_ids"]
    sequences = [list(p) + list(r) for p, r in zip(prompts, responses)]
    rows, width = len(sequences), max(len(seq) for seq in sequences)
    unknown = [name for name in (*required, *optional) if name not in TOKEN_COLUMNS]
    if unknown:
        raise ValueError(f"{unknown} are not TokenBatch columns; they are {list(TOKEN_COLUMNS)}")
    columns = list(required) + [name for name in optional
                                if samples.get(name) is not None and all(v is not None for v in samples[name])]
    missing = [name for name in required if samples.get(name) is None]
    if missing:
        raise ValueError(f"samples have no {', '.join(missing)} column")
    per_token = {name: torch.zeros((rows, width - 1)) for name in columns}  # [B, L-1] each
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)  # [B, L]
    attention = torch.zeros((rows, width), dtype=torch.long)  # [B, L]
    mask = torch.zeros((rows, width - 1))  # [B, L-1]
    loss_masks = samples.get("loss_masks")
    if loss_masks is not None and all(m is None for m in loss_masks):
        loss_masks = None
    spans = torch.zeros((rows, width - 1)) if loss_masks is not None else None  # [B, L-1]
    for row, seq in enumerate(sequences):
        prompt_len, response_len = len(prompts[row]), len(responses[row])
        input_ids[row, : len(seq)] = torch.tensor(seq)
        attention[row, : len(seq)] = 1
        span = slice(prompt_len - 1, prompt_len - 1 + response_len)
        mask[row, span] = 1.0
        if spans is not None:
            spans[row, span] = 1.0
            if loss_masks[row] is not None:
                if len(loss_masks[row]) != response_len:
                    raise ValueError(f"sample {row}: {len(loss_masks[row])} loss_masks for {response_len} response tokens")
                mask[row, span] = torch.tensor([float(m) for m in loss_masks[row]])
        for name in columns:
            with np.errstate(over="ignore"):
                values = np.asarray(samples[name][row], dtype=np.float64).astype(np.float32)
            if values.ndim and values.shape[0] != response_len:
                raise ValueError(f"sample {row}: {values.shape[0]} {name} for {response_len} response tokens")
            per_token[name][row, span] = torch.from_numpy(values) if values.ndim else float(values)
    staleness = samples.get("staleness")
    staleness = torch.tensor([int(s) for s in (staleness if staleness is not None else [0] * rows)])  # [B]
    batch = TokenBatch(input_ids=input_ids, attention=attention, mask=mask, staleness=staleness, span=spans,
                       **per_token)
    return batch.to(device) if device is not None else batch
