"""Cutting sequences of long-tailed lengths into micro-batches (the trainer's, the critic's, the reference
model's chunks), padded or packed.

Padded: a micro-batch's sequences are right-padded to its longest one, B rows of L tokens. Packed (the
default, `train.packing`): they are concatenated into fewer rows, each as wide as the longest sequence,
with position ids that restart at 0 at each sequence, and the model computes on little more than their
tokens. Transformers builds a block-diagonal causal
mask from restarting position ids (masking_utils.find_packed_sequence_indices, for SDPA and eager
attention; flash-attention's varlen kernels on GPUs read the same), so no token attends across a
sequence boundary, and the model's outputs are unpacked to the padded [B, L-1] layout the losses read
(PackedInputs.unpack): the same numbers as the padded forward, at the packed cost. The per-token columns
stay padded: they hold a few floats per token, where the model's activations hold thousands."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from operators.algorithms.columns import PaddedLayout, as_ragged, is_complete, per_token_values
from operators.algorithms.chunking import packed_rows
from operators.algorithms.columns import lengths as column_lengths
from operators.algorithms.shared_prompts import SharedPromptInputs, shared_prompt_inputs

if TYPE_CHECKING:
    import torch


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
class PackedInputs:
    """A micro-batch's sequences packed into rows, for the model's forward, and the way back to the padded
    layout the losses read. Shapes: P rows of W tokens; B sequences, the longest L tokens."""

    input_ids: torch.Tensor  # [P, W] long: sequence after sequence, then a tail of pad_id
    position_ids: torch.Tensor  # [P, W] long: 0, 1, ... restarting at each sequence (and at the tail)
    index: torch.Tensor  # [B, L-1] long: where padded (row, t) sits among the packed rows' P x (W-1) positions
    valid: torch.Tensor  # [B, L-1] bool: t < the row's length - 1 (the rest is padding)

    def model_inputs(self) -> dict:
        """Keyword arguments of a Hugging Face forward on the packed rows. No attention mask and no cache:
        that is when transformers reads packed sequences from the position ids."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "attention_mask": None,
                "use_cache": False}

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position values of the packed rows, [P, W-1] in shifted (next-token) coordinates, at the
        padded [B, L-1] layout: position t of row b is the value after token t of sequence b, 0 at the
        padding. Differentiable (a gather), so a loss on the padded layout trains the packed forward."""
        import torch

        gathered = values.reshape(-1)[self.index]  # [B, L-1]
        return torch.where(self.valid, gathered, torch.zeros((), dtype=gathered.dtype, device=gathered.device))

    def to(self, device, non_blocking: bool = True) -> PackedInputs:
        return PackedInputs(**{name: value.to(device, non_blocking=non_blocking) for name, value in vars(self).items()})


def packed_inputs(sequences: list, pad_id: int = 0, one_row: bool = False) -> PackedInputs:
    """`sequences` (token ids each, a list or a numpy array, at least one token) packed into rows (PackedInputs).

    Rows are as wide as the longest sequence, W = L, each filled first-fit longest first, so a row holds
    several short sequences and the P rows are no more than the B padded ones would be. That bounds the
    attention: SDPA and eager attention compute every row's W x W scores under the block-diagonal mask, so
    one row of all N tokens would cost N^2 where padded rows cost B x L^2. A row's unused tail is pad_id
    with positions of its own (a sequence of its own, never read). `one_row`: one row of all the tokens,
    for flash-attention, whose varlen kernel computes each sequence's attention alone but reads packed
    sequences only from a batch of one row (transformers' _is_packed_sequence)."""
    import torch

    lengths = [len(seq) for seq in sequences]
    if not lengths or min(lengths) < 1:
        raise ValueError("packed_inputs needs at least one sequence, and no empty one")
    longest = max(lengths)
    rows = [list(range(len(sequences)))] if one_row else packed_rows(lengths, longest)
    width = sum(lengths) if one_row else longest
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)  # [P, W]
    positions = np.zeros((len(rows), width), dtype=np.int64)  # [P, W]
    starts = np.zeros(len(sequences), dtype=np.int64)  # [B]: where each sequence starts, flat in [P, W-1]
    for row, members in enumerate(rows):
        at = 0
        for index in members:
            ids[row, at:at + lengths[index]] = sequences[index]
            positions[row, at:at + lengths[index]] = np.arange(lengths[index])
            starts[index] = row * (width - 1) + at
            at += lengths[index]
        positions[row, at:] = np.arange(width - at)
    steps = np.arange(longest - 1, dtype=np.int64)  # [L-1]
    valid = steps[None, :] < (np.asarray(lengths) - 1)[:, None]  # [B, L-1]
    index = np.where(valid, starts[:, None] + steps[None, :], 0)  # [B, L-1]
    return PackedInputs(input_ids=torch.from_numpy(ids), position_ids=torch.from_numpy(positions),
                        index=torch.from_numpy(index), valid=torch.from_numpy(valid))


def check_packing(model, packing: bool, section: str = "train") -> bool:
    """Whether the model packs into one row (flash-attention) rather than rows as wide as the longest
    sequence (packed_inputs). Raises a clear error when `packing` is asked of a model that cannot read
    packed rows: its forward takes no `position_ids` (a custom model's code, say), so nothing would keep
    its sequences apart."""
    import inspect

    if packing and "position_ids" not in inspect.signature(model.forward).parameters:
        raise ValueError(f"train.packing is true but {type(model).__name__}.forward takes no position_ids, so "
                         f"sequences packed into one row would attend to each other ({section}); set train.packing: false")
    # transformers keeps the attention kernel in a private config attribute; it is set on every loaded model
    return packing and str(getattr(model.config, "_attn_implementation", "") or "").startswith("flash")


@dataclass
class TokenBatch:
    """One micro-batch of prompt + response sequences, as the trainer's losses read it.

    Sequences are right-padded to the longest, L tokens; a packed batch also carries them packed into
    rows (`packed`), and the model runs on those (`model_inputs`, then `unpack` its outputs). Per-token
    columns sit in shifted (next-token) coordinates: position t holds the value for predicting token t + 1,
    so `mask` marks the positions whose next token is a response token. A column a sample set lacks is
    None. Shapes: B rows, L tokens.
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
    packed: PackedInputs | None = None  # the sequences packed into rows (None: the model runs padded)
    shared: SharedPromptInputs | None = None  # units of one prompt and its responses (train.share_prompts)

    def model_inputs(self) -> dict:
        """Keyword arguments of the model's forward: the shared-prompt or packed rows, or the padded rows and
        their mask."""
        if self.shared is not None:
            return self.shared.model_inputs()
        if self.packed is not None:
            return self.packed.model_inputs()
        return {"input_ids": self.input_ids, "attention_mask": self.attention}

    def outputs(self, values: torch.Tensor) -> torch.Tensor:
        """The model's per-position outputs [rows, W, ...] at the positions that predict a next token, in the
        layout `targets` pairs with: [P, W-1, ...] packed, [B, L-1, ...] padded, [1, N, ...] shared (the N
        positions predicting a response token, the prompt's last once per response)."""
        return self.shared.select(values) if self.shared is not None else values[:, :-1]

    def targets(self) -> torch.Tensor:
        """The next tokens, in the layout of `outputs`: [P, W-1] packed, [B, L-1] padded, [1, N] shared."""
        if self.shared is not None:
            return self.shared.target[None]
        ids = self.packed.input_ids if self.packed is not None else self.input_ids
        return ids[:, 1:]

    def unpack(self, values: torch.Tensor | None) -> torch.Tensor | None:
        """Values in the layout of `outputs` at the padded [B, L-1] layout (0 at the padding; shared: 0 at the
        prompt positions too, which no loss reads)."""
        if values is None:
            return None
        if self.shared is not None:
            return self.shared.scatter(values)
        return values if self.packed is None else self.packed.unpack(values)

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
                             for name, value in vars(self).items()})  # PackedInputs.to too


def trained_token_counts(samples: dict) -> np.ndarray:
    """[N] int64: the response tokens of each sample that the loss trains: all of them, or the policy's only
    where the sample carries a loss mask (multi-turn episodes: observation tokens are the environment's)."""
    counts = column_lengths(samples["response_token_ids"])
    masks = samples.get("loss_masks")
    if masks is None:
        return counts
    masks = as_ragged(masks, np.int64)
    return np.where(masks.missing_rows(), counts, masks.row_sums()).astype(np.int64)


def token_batch(samples: dict, pad_id: int, required: tuple[str, ...], optional: tuple[str, ...] = (),
                device=None, packed: bool = False, one_row: bool = False, share_prompts: bool = False,
                budget: int = 0, width_limit: int | None = None) -> TokenBatch:
    """A TokenBatch of `samples` (columns of equal length: prompt_token_ids, response_token_ids, and
    the per-token columns): the `required` TOKEN_COLUMNS, and each `optional` one when every sample
    carries it. A per-token value is one float per response (broadcast over its tokens) or one per
    response token; float32, overflowing to +-inf (the trainer's NaN guard then sees it) rather than
    raising. `loss_masks` (optional, one 0/1 per response token): only the 1s are in `mask`. `packed`:
    the sequences also packed into rows for the model (packed_inputs; `one_row`: one row of them all).
    `share_prompts`: instead, each prompt laid out once before its responses (shared_prompts.py; units within
    the micro-batch `budget`, cut at `width_limit`: the step's, shared_prompts.step_width_limit, for a
    micro-batch of a chunked step).

    The columns are numpy (operators/algorithms/columns.py) or lists; each tensor is filled by one
    scatter of the column's flat values, so nothing here runs per token in Python."""
    import torch

    prompts = as_ragged(samples["prompt_token_ids"], np.int64)
    responses = as_ragged(samples["response_token_ids"], np.int64)
    unknown = [name for name in (*required, *optional) if name not in TOKEN_COLUMNS]
    if unknown:
        raise ValueError(f"{unknown} are not TokenBatch columns; they are {list(TOKEN_COLUMNS)}")
    columns = list(required) + [name for name in optional
                                if samples.get(name) is not None and is_complete(samples[name])]
    missing = [name for name in required if samples.get(name) is None]
    if missing:
        raise ValueError(f"samples have no {', '.join(missing)} column")
    layout = PaddedLayout(prompts, responses)
    if (layout.prompt_len < 1).any():
        raise ValueError(f"sample {int(np.argmin(layout.prompt_len))}: no prompt token (the first response "
                         "token is predicted from the prompt's last)")
    problems = []  # (sample, check order, message): the first sample's first problem is raised
    trained = np.ones(layout.tokens, dtype=np.float32)  # [R]: 1 at each response token the loss trains
    spans = None
    loss_masks = samples.get("loss_masks")
    if loss_masks is not None:
        loss_masks = as_ragged(loss_masks, np.float64)
        present = ~loss_masks.missing_rows()
        if present.any():
            spans = layout.scatter(np.ones(layout.tokens, dtype=np.float32))
            wrong = np.flatnonzero(present & (loss_masks.lengths != layout.response_len))
            if wrong.size:
                row = int(wrong[0])
                problems.append((row, 0, f"sample {row}: {loss_masks.lengths[row]} loss_masks for "
                                         f"{layout.response_len[row]} response tokens"))
            else:
                trained[np.repeat(present, layout.response_len)] = loss_masks.values
    per_token = {}
    for order, name in enumerate(columns, start=1):
        values, row, count = per_token_values(samples[name], layout.response_len)
        if values is None:
            problems.append((row, order, f"sample {row}: {count} {name} for {layout.response_len[row]} response tokens"))
            continue
        with np.errstate(over="ignore"):
            per_token[name] = layout.scatter(values.astype(np.float32))
    if problems:
        raise ValueError(min(problems)[2])
    staleness = samples.get("staleness")
    staleness = np.zeros(layout.rows, dtype=np.int64) if staleness is None else np.array(staleness, dtype=np.int64)
    input_ids = layout.input_ids(prompts, responses, pad_id)  # [B, L]
    rows_packed = rows_shared = None
    if share_prompts:
        rows_shared = shared_prompt_inputs(prompts, responses, pad_id, budget, width_limit)
    elif packed:  # each sequence a view of its padded row
        rows_packed = packed_inputs([input_ids[row, :length] for row, length in enumerate(layout.seq_len)],
                                    pad_id, one_row)
    batch = TokenBatch(input_ids=torch.from_numpy(input_ids), attention=torch.from_numpy(layout.attention()),
                       mask=torch.from_numpy(layout.scatter(trained)), staleness=torch.from_numpy(staleness),
                       span=None if spans is None else torch.from_numpy(spans), packed=rows_packed, shared=rows_shared,
                       **{name: torch.from_numpy(values) for name, values in per_token.items()})
    return batch.to(device) if device is not None else batch
