"""Batches for the loop.

One example per row (the default): rows padded to the longest of the batch, a 2D attention mask.
Packed rows (a dataset with `position_ids`, see tunelab/data/pack.py): several examples per row.
transformers 5 only infers example boundaries from `position_ids` when no attention mask and no KV
cache are given, and a causal LM builds a cache unless `use_cache=False` reaches it, which a batch of
tensors cannot carry. So a packed batch brings its own 4D additive mask, block-diagonal and causal,
which the sdpa and eager kernels apply as given. flash_attention_2 takes no 4D mask: there the batch
is flattened into one row and the kernel's varlen path splits it where `position_ids` restart; so is it
for tunelab's own attention by example (train/segments.py: one process on CPU, SDPA).
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from tunelab.train import segments

IGNORE = -100
# Finite, so that a float16/bfloat16 cast stays finite too and summing a mask cannot overflow to -inf.
MASKED = -1e9


def _pad(rows: list[dict], pad_id: int, third: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad rows to the longest: ids with pad_id, labels with IGNORE, and a third tensor that is
    the rows' `third` field (position ids), or 1 on real tokens (the attention mask) when None."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    other = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        labels[i, :n] = torch.tensor(r["labels"])
        other[i, :n] = torch.tensor(r[third]) if third else 1
    return ids, labels, other


def collate(pad_id: int):
    def fn(rows: list[dict]) -> dict[str, torch.Tensor]:
        ids, labels, mask = _pad(rows, pad_id, None)
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    return fn


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, L, L) additive mask: a token sees earlier tokens of its own example only.
    An example starts where position_ids is 0."""
    segment = (position_ids == 0).cumsum(dim=1)
    same = segment[:, :, None] == segment[:, None, :]
    causal = torch.ones(position_ids.shape[1], position_ids.shape[1], dtype=torch.bool).tril()
    allowed = same & causal
    return torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, MASKED)[:, None]


def collate_packed(pad_id: int, varlen: bool = False):
    """Padding gets position 0 at every token: each pad is a one-token example of its own, which
    nothing else attends to and whose label is IGNORE."""

    def fn(rows: list[dict]) -> dict[str, torch.Tensor]:
        if varlen:  # one row, no padding: the flash-attention varlen path
            cat = lambda key: torch.tensor([t for r in rows for t in r[key]], dtype=torch.long)[None]  # noqa: E731
            return {"input_ids": cat("input_ids"), "labels": cat("labels"), "position_ids": cat("position_ids")}
        ids, labels, pos = _pad(rows, pad_id, "position_ids")
        return {"input_ids": ids, "labels": labels, "position_ids": pos, "attention_mask": block_causal_mask(pos)}

    return fn


def is_packed(ds) -> bool:
    return "position_ids" in (getattr(ds, "column_names", None) or [])


class LengthGrouped(torch.utils.data.Sampler):
    """Batches of examples of similar length in a random order (transformers' `group_by_length`): each
    epoch's shuffled indices are cut into megabatches of `MEGA` batches, each megabatch is sorted by length
    and cut into batches, and then the batches are shuffled, so a step's rows are alike in length but the
    lengths do not trend over the epoch. It draws only from the loader's generator, so the data position
    a checkpoint saves (BatchStream: the generator's state when the epoch began) replays it exactly."""

    MEGA = 50

    def __init__(self, lengths: list[int], batch_size: int, generator: torch.Generator):
        self.lengths, self.batch_size, self.generator = lengths, batch_size, generator

    def __len__(self) -> int:
        return -(-len(self.lengths) // self.batch_size)

    def __iter__(self):
        perm = torch.randperm(len(self.lengths), generator=self.generator).tolist()
        size, mega = self.batch_size, self.batch_size * self.MEGA
        batches = []
        for start in range(0, len(perm), mega):
            part = sorted(perm[start:start + mega], key=lambda i: -self.lengths[i])
            batches += [part[i:i + size] for i in range(0, len(part), size)]
        yield from (batches[i] for i in torch.randperm(len(batches), generator=self.generator).tolist())


def lengths_of(ds) -> list[int]:
    """Tokens per example, from the Arrow list column (in the dataset's row order, whatever its index mapping)."""
    import pyarrow.compute as pc

    return pc.list_value_length(ds.select_columns(["input_ids"]).with_format("arrow")[:]["input_ids"]).to_pylist()


def loader(ds, batch_size: int, pad_id: int, *, shuffle: bool, seed: int = 0, attn: str = "sdpa",
           group_by_length: bool = False) -> DataLoader:
    """`attn` is the model's attention implementation while it trains; it only matters for packed datasets."""
    g = torch.Generator().manual_seed(seed)
    varlen = attn.startswith("flash") or attn == segments.NAME
    fn = collate_packed(pad_id, varlen=varlen) if is_packed(ds) else collate(pad_id)
    if group_by_length and shuffle:
        return DataLoader(ds.with_format(None), batch_sampler=LengthGrouped(lengths_of(ds), batch_size, g),
                          generator=g, collate_fn=fn)
    return DataLoader(ds.with_format(None), batch_size=batch_size, shuffle=shuffle, generator=g, collate_fn=fn)


def label_tokens(batch: dict) -> int:
    """Tokens that carry a loss after the causal shift."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def batch_tokens(batch: dict) -> int:
    """Real (non-padding) tokens of a batch, whatever its layout. In packed batches a padding token is
    a position-0 token followed by another position 0 (or the row's end); every real example has at
    least two tokens (a prompt token and a reply token), so its start is followed by position 1."""
    mask = batch.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        return int(mask.sum())
    pos = batch["position_ids"]
    starts_real = (pos[:, :-1] == 0) & (pos[:, 1:] == 1)
    return int((pos > 0).sum() + starts_real.sum())
