"""The columns a train step's samples travel in: numpy arrays, not Python lists.

A per-token column (token ids, log-probs, loss masks, per-token advantages, returns, values) is a `Ragged`
column: one flat values array and offsets, sample i's values at values[offsets[i]:offsets[i + 1]]. A
per-response column (an advantage per response, staleness, critic version) is a 1-D numpy array. Both
pickle as a few flat buffers (Ray sends numpy buffers out of band), cut per rank and per micro-batch with
one gather, and become the trainer's padded tensors with one scatter (operators.algorithms.batching.token_batch).

A column still reads like the list it replaces: `len(column)`, `column[i]` (a numpy view, or None where
the sample lacks the column), iteration. The helpers below (`take`, `lengths`, `is_complete`,
`as_ragged`) take either kind, so samples given as plain lists (tests, a user's own loop) keep working.
`PaddedLayout` and `per_token_values` are the scatter: where each response token sits in the padded
[B, L] / [B, L-1] layouts, and a per-token column's values at those tokens.
"""

from __future__ import annotations

import operator

import numpy as np


class Ragged:
    """Rows of different lengths in one flat array. Shapes: N rows, T values in all."""

    __slots__ = ("values", "offsets", "missing")
    __hash__ = None  # compared by value (__eq__), so not hashable

    def __init__(self, values: np.ndarray, offsets: np.ndarray, missing: np.ndarray | None = None):
        self.values = values  # [T]
        self.offsets = offsets  # [N + 1] int64: row i is values[offsets[i]:offsets[i + 1]]
        # [N] bool: True where a row has no entry (it reads as None and holds no values); None: none missing
        self.missing = missing if missing is not None and missing.any() else None

    @classmethod
    def from_rows(cls, rows, dtype) -> Ragged:
        """A column of `rows`: each a sequence of numbers (list, numpy array) or None (no entry)."""
        rows = list(rows)
        missing = np.fromiter((row is None for row in rows), dtype=bool, count=len(rows))
        arrays = [np.asarray(row, dtype=dtype).reshape(-1) for row in rows if row is not None]
        counts = np.zeros(len(rows), dtype=np.int64)
        counts[~missing] = [len(array) for array in arrays]
        values = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
        return cls(values, _offsets(counts), missing)

    @property
    def lengths(self) -> np.ndarray:
        """[N] int64: values per row (0 where missing)."""
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index):
        """Row `index` as a numpy view (None where missing); a slice gives a list of them, as a list would."""
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = operator.index(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of a column of {len(self)}")
        if self.missing is not None and self.missing[index]:
            return None
        return self.values[self.offsets[index]:self.offsets[index + 1]]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Ragged):
            return NotImplemented
        return (np.array_equal(self.offsets, other.offsets) and np.array_equal(self.values, other.values)
                and np.array_equal(self.missing_rows(), other.missing_rows()))

    def __repr__(self) -> str:
        return f"Ragged({len(self)} rows, {self.values.size} values of {self.values.dtype})"

    def missing_rows(self) -> np.ndarray:
        """[N] bool: True where a row has no entry."""
        return self.missing if self.missing is not None else np.zeros(len(self), dtype=bool)

    def take(self, indices) -> Ragged:
        """The rows at `indices`, in that order: one gather of their values."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        counts = self.lengths[indices]
        offsets = _offsets(counts)
        # position of each taken value in self.values: its row's old start + its place in the row
        source = np.repeat(self.offsets[indices] - offsets[:-1], counts) + np.arange(offsets[-1])
        missing = self.missing[indices] if self.missing is not None else None
        return Ragged(self.values[source], offsets, missing)

    def row_sums(self) -> np.ndarray:
        """[N] the sum of each row's values (0 where missing)."""
        running = np.concatenate([[0], np.cumsum(self.values, dtype=np.int64 if self.values.dtype.kind in "biu"
                                                 else np.float64)])
        return running[self.offsets[1:]] - running[self.offsets[:-1]]

    def tolist(self) -> list:
        """The column as Python lists (None where missing)."""
        return [None if row is None else row.tolist() for row in self]


def _offsets(counts: np.ndarray) -> np.ndarray:
    """[N + 1] int64 offsets of rows of `counts` values."""
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets


def as_ragged(column, dtype) -> Ragged:
    """A per-token column as a Ragged one (converted from a list of sequences / None if need be)."""
    return column if isinstance(column, Ragged) else Ragged.from_rows(column, dtype)


def lengths(column) -> np.ndarray:
    """[N] int64: the length of each row of a per-token column."""
    if isinstance(column, Ragged):
        return column.lengths
    return np.fromiter((len(row) for row in column), dtype=np.int64, count=len(column))


def take(column, indices):
    """The entries of a column (Ragged, numpy array or list; None stays None) at `indices`, in that order."""
    if column is None:
        return None
    if isinstance(column, Ragged):
        return column.take(indices)
    if isinstance(column, np.ndarray):
        return column[np.asarray(indices, dtype=np.int64).reshape(-1)]
    return [column[i] for i in indices]


def is_complete(column) -> bool:
    """Whether every sample has an entry in the column (no None)."""
    if isinstance(column, Ragged):
        return column.missing is None
    if isinstance(column, np.ndarray) and column.dtype != object:
        return True
    return all(entry is not None for entry in column)


class PaddedLayout:
    """Where each response token of B prompt + response sequences sits in the padded [B, L] and the shifted
    [B, L-1] layouts: R response tokens in all, in sample order."""

    def __init__(self, prompts: Ragged, responses: Ragged):
        self.rows = len(responses)
        self.prompt_len, self.response_len = prompts.lengths, responses.lengths  # [B] each
        self.seq_len = self.prompt_len + self.response_len  # [B]
        self.width = int(self.seq_len.max())  # L
        self.tokens = int(self.response_len.sum())  # R
        self.row = np.repeat(np.arange(self.rows), self.response_len)  # [R]: each response token's sample
        place = np.arange(self.tokens) - np.repeat(responses.offsets[:-1], self.response_len)  # [R]: in its response
        # [R]: its column in [B, L-1]: position t predicts token t + 1, so a response starts at prompt length - 1
        self.shifted = np.repeat(self.prompt_len - 1, self.response_len) + place

    def scatter(self, values: np.ndarray) -> np.ndarray:
        """[R] values per response token -> [B, L-1] float32, 0 elsewhere."""
        out = np.zeros((self.rows, self.width - 1), dtype=np.float32)
        out[self.row, self.shifted] = values
        return out

    def input_ids(self, prompts: Ragged, responses: Ragged, pad_id: int) -> np.ndarray:
        """[B, L] int64: prompt, response, then pad_id."""
        ids = np.full((self.rows, self.width), pad_id, dtype=np.int64)
        prompt_row = np.repeat(np.arange(self.rows), self.prompt_len)
        ids[prompt_row, np.arange(prompt_row.size) - np.repeat(prompts.offsets[:-1], self.prompt_len)] = prompts.values
        ids[self.row, self.shifted + 1] = responses.values
        return ids

    def attention(self) -> np.ndarray:
        """[B, L] int64: 1 on real tokens."""
        return (np.arange(self.width)[None, :] < self.seq_len[:, None]).astype(np.int64)


def per_token_values(column, counts: np.ndarray) -> tuple[np.ndarray | None, int, int]:
    """A per-token column at the R response tokens of samples of `counts` tokens each, float64 [R]: one
    value per response (a 1-D array, or a number in a list) broadcast over its tokens, or one per token;
    NaN for a sample without an entry. A sample with another count of values gives (None, that sample,
    its count) instead."""
    if isinstance(column, np.ndarray) and column.ndim == 1 and column.dtype != object:
        return np.repeat(column.astype(np.float64), counts), -1, 0
    if not isinstance(column, Ragged):  # a list: a number, a sequence or None per sample
        column = Ragged.from_rows([np.full(count, np.nan if entry is None else entry, dtype=np.float64)
                                   if np.ndim(entry) == 0 else entry for entry, count in zip(column, counts)],
                                  np.float64)
    present = ~column.missing_rows()
    wrong = np.flatnonzero(present & (column.lengths != counts))
    if wrong.size:
        return None, int(wrong[0]), int(column.lengths[wrong[0]])
    if column.missing is None:
        return column.values.astype(np.float64, copy=False), -1, 0
    values = np.full(int(counts.sum()), np.nan)
    values[np.repeat(present, counts)] = column.values
    return values, -1, 0
