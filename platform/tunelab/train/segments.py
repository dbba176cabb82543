"""Packed rows attended example by example, in one process on CPU: no mask, no score outside an example.

A packed batch (`data.pack`, train/data.py) on SDPA carries a (rows, 1, L, L) block-diagonal mask, and the
kernel computes all L x L scores of every row before the mask discards most of them (a row of 256 tokens
holding examples of about 100 computes five times the scores that count), with no causal shortcut since a
mask is given. Here the loop flattens a packed batch into one row instead, as for flash-attention's varlen
path, and while a step trains the model's attention implementation is this module's `NAME`: each example
(a run of positions that starts where `position_ids` is 0) goes through causal SDPA over its own keys and
values. Losses and gradients are the masked path's up to float rounding (tests/test_train_fast_paths.py).

`usable(model)` decides, once per model: its attention is SDPA, it is on CPU (on a GPU a kernel launch per
example and layer is not measured to pay), and on a short two-example input the examples attended this way
give the model's own logits for each example run alone (so its attention goes through transformers'
attention interface and sees nothing else: no sliding window, no soft-capping, no prompt-learning prefix).
Otherwise the batch keeps its mask.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from tunelab.train.attention_swap import probe_ids, swapped, verdict

NAME = "tunelab_by_example"


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal SDPA over each example of a flattened packed row; examples start where position_ids is 0 (each in
    fp32 under bf16 autocast when it is short: train/cpu_attention.py)."""
    from tunelab.train.cpu_attention import sdpa

    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or position_ids is None or query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise RuntimeError(f"{NAME} attention takes one flattened packed row with its position_ids, no mask and no "
                           "cached keys")
    starts = (position_ids[0] == 0).nonzero().squeeze(1).tolist()
    if not starts or starts[0] != 0:
        raise RuntimeError(f"{NAME} attention: a packed row starts at position 0")
    ends = [*starts[1:], query.shape[2]]
    outs = [sdpa(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None,
                 dropout=dropout, scaling=scaling, is_causal=True)[0]
            for a, b in zip(starts, ends)]
    return torch.cat(outs, dim=1), None  # (1, tokens, heads, dim), as attention modules expect


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, _attention)


def attending_by_example(model: Any) -> contextlib.AbstractContextManager:
    """The model's attention is `NAME` inside; restored on exit."""
    _register()
    return swapped(model, NAME)


def usable(model: Any) -> bool:
    """Whether packed rows of `model` may be attended example by example (see the module docstring)."""
    return verdict(model, NAME, _check)


def _check(model: Any, config: Any) -> bool:
    ids = probe_ids(config, (1, 13))
    lengths = (7, 6)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    apart = torch.cat([model(input_ids=part).logits[0] for part in ids.split(lengths, dim=1)])
    with attending_by_example(model):
        together = model(input_ids=ids, position_ids=positions).logits[0]
    scale = apart.abs().max().clamp_min(1.0)
    return bool(((together - apart).abs().max() / scale) < 1e-4)
