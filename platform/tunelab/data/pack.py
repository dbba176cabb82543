"""Packing: examples -> rows of at most `length` tokens, several examples per row.

Each row carries `position_ids` that restart at 0 for every example; that is how the batch side
(train/data.py) recovers the example boundaries and keeps attention inside each example. The first
label of every example is IGNORE, so no example learns to predict the start of the next one: the
losses of a packed row are exactly those of its examples run one by one.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

import numpy as np

from tunelab.data.tokenize import IGNORE, Tokenized


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of example indices: longest first, each into the fullest row it still fits in."""
    free: list[tuple[int, int]] = []  # (free tokens, row), kept sorted
    rows: list[list[int]] = []
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        at = bisect_left(free, (n, -1))
        if at == len(free):
            rows.append([int(i)])
            left, row = capacity - n, len(rows) - 1
        else:
            left, row = free.pop(at)
            rows[row].append(int(i))
            left -= n
        if left > 0:
            insort(free, (left, row))
    return rows


@dataclass
class Packed:
    ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    offsets: np.ndarray  # row r is [offsets[r], offsets[r+1])

    def __len__(self) -> int:
        return len(self.offsets) - 1


def pack(examples: Tokenized, length: int) -> Packed:
    rows = best_fit_decreasing(examples.lengths(), length)
    order = np.fromiter((i for row in rows for i in row), dtype=np.int64, count=len(examples))
    flat = examples.take(order)
    lens = flat.lengths()
    starts = flat.offsets[:-1]
    position_ids = (np.arange(flat.offsets[-1]) - np.repeat(starts, lens)).astype(np.int32)
    labels = flat.labels.copy()
    labels[starts[lens > 0]] = IGNORE
    row_sizes = [int(lens[a:b].sum()) for a, b in _row_bounds(rows)]
    offsets = np.concatenate([[0], np.cumsum(row_sizes)]).astype(np.int64)
    return Packed(flat.ids, labels, position_ids, offsets)


def _row_bounds(rows: list[list[int]]):
    at = 0
    for row in rows:
        yield at, at + len(row)
        at += len(row)
