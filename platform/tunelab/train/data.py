"""Batches for the loop: pad to the longest row of the batch, labels padded with -100."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

IGNORE = -100


def collate(pad_id: int):
    def fn(rows: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n] = torch.tensor(r["input_ids"])
            labels[i, :n] = torch.tensor(r["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    return fn


def loader(ds, batch_size: int, pad_id: int, *, shuffle: bool, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(ds.with_format(None), batch_size=batch_size, shuffle=shuffle, generator=g,
                      collate_fn=collate(pad_id))


def forever(dl: DataLoader):
    """Epoch after epoch; the loader's own generator keeps the order reproducible."""
    while True:
        yield from dl


def label_tokens(batch: dict) -> int:
    """Tokens that carry a loss after the causal shift."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())
