"""Shared-prompt packing (`train.share_prompts`): a group's responses laid after one copy of their prompt.

A GRPO-style group is n responses to one prompt. Packed sequence by sequence (batching.packed_inputs) the
prompt is computed n times; here it is laid out once and followed by each of the responses, and a 4D
attention mask lets every response token attend to the prompt and, causally, to its own response, never to a
group-mate's. A response's position ids continue from the prompt's length, as in its own sequence, so each of
its tokens sees the keys, values and positions it sees alone: the same log-probs, and the same gradients
(the prompt's share is the sum of what each copy of it would get).

The output position that predicts a response's first token is the prompt's last one, which the group shares,
so outputs are read by explicit pairs: `source` (the flat [P x W] position whose output predicts the token)
and `target` (the token), one per response token, then scattered back to the padded [B, L-1] layout the
losses read, with zeros at the prompt and the padding (the losses only read response positions).

A unit is one copy of a prompt and the responses laid after it. A group whose prompt and responses pass
`width_limit` tokens is cut into several units, each with a copy of the prompt. Units are packed first-fit,
longest first, into rows as wide as the longest unit. SDPA and eager attention compute each row's W x W
scores, so the limit (`unit_width_limit`: at most WIDTH_FACTOR x the longest sequence, and within the
micro-batch budget) bounds what sharing adds to attention, while it saves (n - 1) x the prompt's tokens of
every layer's linear work. Samples whose prompts differ share nothing and cost what sequence packing costs.
flash-attention's varlen kernels take no such mask: the trainer refuses the option there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from operators.algorithms.chunking import packed_chunks, packed_rows

if TYPE_CHECKING:
    import torch

# A unit (a prompt and its responses) is at most this many times as wide as the longest sequence it holds.
WIDTH_FACTOR = 4


def unit_width_limit(longest: int, budget: int = 0) -> int:
    """The widest a unit may grow: WIDTH_FACTOR x the longest sequence (prompt + response), and no wider than
    the micro-batch budget (`train.micro_batch_tokens`, 0: none), but never narrower than that sequence."""
    limit = WIDTH_FACTOR * longest
    return max(longest, min(limit, budget) if budget else limit)


def step_width_limit(prompts: list, response_lengths, budget: int = 0) -> int:
    """unit_width_limit of a step's samples (their longest prompt + response): the one limit its micro-batches
    are cut by (shared_chunks) and laid out with (shared_prompt_inputs(width_limit=...)). A micro-batch's own
    longest sequence is often shorter, and a limit taken from it would cut a group the chunker kept whole into
    more units, each with a copy of the prompt: more token slots than the chunk was planned with."""
    longest = max((len(p) + int(n) for p, n in zip(prompts, response_lengths)), default=1)
    return unit_width_limit(longest, budget)


def shared_units(prompts: list, response_lengths, width_limit: int) -> list[list[int]]:
    """Sample indices per unit: the samples with the same prompt, in their order, cut where the prompt and
    their responses would pass `width_limit` tokens (a unit holds at least one sample). Units come in the
    order of their first sample."""
    groups: dict[bytes, list[int]] = {}
    for index, prompt in enumerate(prompts):
        groups.setdefault(np.asarray(prompt, dtype=np.int64).tobytes(), []).append(index)
    units: list[list[int]] = []
    for members in groups.values():
        prompt_len = len(prompts[members[0]])
        unit: list[int] = []
        width = prompt_len
        for index in members:
            length = int(response_lengths[index])
            if unit and width + length > width_limit:
                units.append(unit)
                unit, width = [], prompt_len
            unit.append(index)
            width += length
        units.append(unit)
    return units


def unit_lengths(units: list[list[int]], prompt_lengths, response_lengths) -> list[int]:
    """Tokens of each unit: one prompt and all its responses."""
    return [int(prompt_lengths[unit[0]]) + int(sum(int(response_lengths[i]) for i in unit)) for unit in units]


@dataclass
class SharedPromptInputs:
    """A micro-batch laid out in units (a prompt, then its responses) packed into P rows of W tokens, and the
    way from the model's outputs to the padded [B, L-1] layout. N: the response tokens of the micro-batch."""

    input_ids: torch.Tensor  # [P, W] long: unit after unit, then a tail of pad_id
    position_ids: torch.Tensor  # [P, W] long: 0.. over a prompt, each response going on from its prompt's length
    attention_mask: torch.Tensor  # [P, 1, W, W] bool (True: attends), or additive (0 / the dtype's lowest)
    source: torch.Tensor  # [N] long: the flat [P x W] position whose output predicts each response token
    target: torch.Tensor  # [N] long: that token
    dest: torch.Tensor  # [N] long: its flat position in the padded [B, L-1] layout
    shape: tuple[int, int]  # (B, L-1)

    def model_inputs(self) -> dict:
        """Keyword arguments of a Hugging Face forward: transformers uses a 4D mask as given."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids,
                "attention_mask": self.attention_mask, "use_cache": False}

    def select(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position model outputs [P, W, ...] at the positions that predict the response tokens: [1, N, ...]."""
        return values.reshape(-1, *values.shape[2:])[self.source][None]

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """Values per response token, [1, N], at the padded [B, L-1] layout, 0 elsewhere. Differentiable."""
        import torch

        flat = torch.zeros(self.shape[0] * self.shape[1], dtype=values.dtype, device=values.device)
        return flat.index_put((self.dest,), values.reshape(-1)).reshape(self.shape)

    def for_kernel(self, mask_kind: str | None, dtype) -> SharedPromptInputs:
        """The inputs as the attention kernel reads them (`mask_kind` from check_shared_prompts): an additive mask
        of `dtype` for eager attention, which adds it to its scores; as they are for SDPA."""
        return self.additive(dtype) if mask_kind == "additive" else self

    def additive(self, dtype) -> SharedPromptInputs:
        """The same inputs with an additive mask of `dtype` (eager attention adds the mask to its scores)."""
        import torch

        mask = self.attention_mask
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        return SharedPromptInputs(**{**vars(self), "attention_mask": mask})

    def to(self, device, non_blocking: bool = True) -> SharedPromptInputs:
        return SharedPromptInputs(**{name: value if name == "shape" else value.to(device, non_blocking=non_blocking)
                                     for name, value in vars(self).items()})


def shared_prompt_inputs(prompts: list, responses: list, pad_id: int = 0, budget: int = 0,
                         width_limit: int | None = None) -> SharedPromptInputs:
    """`prompts` and `responses` (token ids per sample; every prompt at least one token) laid out in units
    (shared_units) packed into rows (SharedPromptInputs). Units are cut at `width_limit`: a micro-batch of a
    chunked step takes its step's (step_width_limit), the one its chunk was planned with; None: the limit of
    these samples (unit_width_limit of their longest sequence and `budget`)."""
    import torch

    prompt_len = np.array([len(p) for p in prompts], dtype=np.int64)
    response_len = np.array([len(r) for r in responses], dtype=np.int64)
    if not len(prompts) or prompt_len.min() < 1:
        raise ValueError("shared_prompt_inputs needs at least one sample, and a prompt token in each")
    longest = int((prompt_len + response_len).max())
    if width_limit is None:
        width_limit = unit_width_limit(longest, budget)
    units = shared_units(prompts, response_len, max(width_limit, longest))
    lengths = unit_lengths(units, prompt_len, response_len)
    width = max(lengths)
    rows = packed_rows(lengths, width)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)  # [P, W]
    positions = np.zeros((len(rows), width), dtype=np.int64)  # [P, W]
    allowed = np.zeros((len(rows), width, width), dtype=bool)  # [P, W, W]: query attends to key
    source, target, dest = [], [], []
    padded_width = longest - 1  # L - 1
    for row, members in enumerate(rows):
        at = 0
        for unit in members:
            prompt = np.asarray(prompts[units[unit][0]], dtype=np.int64)
            start, plen = at, len(prompt)
            ids[row, at:at + plen] = prompt
            positions[row, at:at + plen] = np.arange(plen)
            allowed[row, at:at + plen, at:at + plen] = np.tri(plen, dtype=bool)
            at += plen
            for index in units[unit]:
                response = np.asarray(responses[index], dtype=np.int64)
                n = len(response)
                ids[row, at:at + n] = response
                positions[row, at:at + n] = np.arange(plen, plen + n)
                allowed[row, at:at + n, start:start + plen] = True
                allowed[row, at:at + n, at:at + n] = np.tri(n, dtype=bool)
                if n:  # token j is predicted after the prompt's last (j = 0) or the response's token j - 1
                    source.append(row * width + np.concatenate(([start + plen - 1], at + np.arange(n - 1))))
                    target.append(response)
                    dest.append(index * padded_width + plen - 1 + np.arange(n))
                at += n
        tail = np.arange(at, width)
        allowed[row, tail, tail] = True  # the unused tail attends to itself only (no row without a key)
        positions[row, at:] = np.arange(width - at)

    def flat(parts: list) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64))

    return SharedPromptInputs(input_ids=torch.from_numpy(ids), position_ids=torch.from_numpy(positions),
                              attention_mask=torch.from_numpy(allowed[:, None]), source=flat(source),
                              target=flat(target), dest=flat(dest), shape=(len(prompts), padded_width))


def shared_chunks(prompts: list, response_lengths, budget: int) -> list[list[int]]:
    """Sample indices per micro-batch when prompts are shared: units (shared_units, cut at step_width_limit)
    cut into micro-batches of at most `budget` token slots (chunking.packed_chunks on the units' lengths), so a
    group stays together where it fits. Each micro-batch lists its indices in ascending order; `budget` 0: one
    micro-batch. Lay each out with shared_prompt_inputs(width_limit=step_width_limit(...)) to get these units."""
    if not budget:
        return [list(range(len(prompts)))] if len(prompts) else []
    prompt_len = np.array([len(p) for p in prompts], dtype=np.int64)
    response_len = np.asarray(response_lengths, dtype=np.int64)
    units = shared_units(prompts, response_len, step_width_limit(prompts, response_len, budget))
    chunks = packed_chunks(unit_lengths(units, prompt_len, response_len), budget)
    return [sorted(i for unit in chunk for i in units[unit]) for chunk in chunks]


def check_shared_prompts(model, share_prompts: bool, packing: bool = True, section: str = "train") -> str | None:
    """How the model takes the shared-prompt mask: "bool" (SDPA), "additive" (eager attention adds it to its
    scores), or None when prompts are not shared. Raises a clear error without packing, and for an attention
    kernel that cannot read a 4D mask (flash-attention's varlen kernels; any other)."""
    if not share_prompts:
        return None
    if not packing:
        raise ValueError(f"{section}.share_prompts lays prompts out in packed rows: it needs packing=True "
                         f"({section}.packing: true)")
    # transformers keeps the attention kernel in a private config attribute; it is set on every loaded model
    kernel = str(getattr(model.config, "_attn_implementation", "") or "")
    if kernel in ("sdpa", "eager"):
        return "bool" if kernel == "sdpa" else "additive"
    raise ValueError(f"{section}.share_prompts needs SDPA or eager attention (a 4D mask keeps each response to its "
                     f"prompt); this model runs {kernel or 'an unknown kernel'}. Set {section}.share_prompts: false")
