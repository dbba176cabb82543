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

Under torch.compile (`train.compile`) the split into examples, which reads positions into Python, would break the
compiled graph in every layer; there the examples are attended inside one custom operator (`by_example_sdpa`),
opaque to the compiler: the same SDPA calls, each example's output and log-sum-exp kept for the kernel's backward
as autograd keeps them for SDPA (recomputing them cost about 1% of a compiled SmolLM2 step); an example run in fp32
under bf16 autocast is recomputed instead, as its output is kept in bf16.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
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
    if torch.compiler.is_compiling():
        return _compiled_attention(query, key, value, position_ids, scaling, dropout), None
    outs = [sdpa(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None,
                 dropout=dropout, scaling=scaling, is_causal=True)[0]
            for a, b in _examples(position_ids, query.shape[2])]
    return torch.cat(outs, dim=1), None  # (1, tokens, heads, dim), as attention modules expect


def _examples(position_ids: torch.Tensor, length: int) -> list[tuple[int, int]]:
    """(start, end) of each example of a flattened packed row."""
    starts = (position_ids[0] == 0).nonzero().squeeze(1).tolist()
    if not starts or starts[0] != 0:
        raise RuntimeError(f"{NAME} attention: a packed row starts at position 0")
    return list(zip(starts, [*starts[1:], length]))


def _compiled_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, position_ids: torch.Tensor,
                        scaling: float | None, dropout: float) -> torch.Tensor:
    """`_attention` as the compiler sees it: the examples' SDPA calls in one opaque operator."""
    from tunelab.train.cpu_attention import SHORT_KEYS

    if dropout:
        raise RuntimeError(f"{NAME} attention under torch.compile takes no attention dropout")
    device = query.device.type
    fp32_below = 0
    if torch.is_autocast_enabled(device):  # as autocast runs SDPA: in its dtype, short examples in fp32 on a CPU
        half = torch.get_autocast_dtype(device)
        query, key, value = query.to(half), key.to(half), value.to(half)
        fp32_below = SHORT_KEYS if device == "cpu" else 0
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out, _ = by_example_sdpa(query, key, value, position_ids, scale, fp32_below)
    return out.transpose(1, 2).contiguous()


def _pieces(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, position_ids: torch.Tensor,
            fp32_below: int) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each example's (start, end, q, k, v), in fp32 when it is shorter than `fp32_below`."""
    for a, b in _examples(position_ids, query.shape[2]):
        q, k, v = query[:, :, a:b], key[:, :, a:b], value[:, :, a:b]
        if b - a < fp32_below:
            q, k, v = q.float(), k.float(), v.float()
        yield a, b, q, k, v


# torch's CPU SDPA kernel and its backward, as autograd calls them for F.scaled_dot_product_attention on a CPU
# (the same numbers, key and value heads shared by query heads as enable_gqa does).
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@torch.library.custom_op("tunelab::by_example_sdpa", mutates_args=(), device_types="cpu")
def by_example_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, position_ids: torch.Tensor,
                    scale: float, fp32_below: int) -> tuple[torch.Tensor, torch.Tensor]:
    """((1, heads, tokens, dim), (1, heads, tokens)): causal SDPA over each example, and each position's fp32
    log-sum-exp of its scores; an example shorter than `fp32_below` in fp32, its output in the inputs' dtype."""
    outs, lses = [], []
    for _, _, q, k, v in _pieces(query, key, value, position_ids, fp32_below):
        out, lse = _FLASH(q, k, v, 0.0, True, scale=scale)
        outs.append(out.to(query.dtype))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


@torch.library.custom_op("tunelab::by_example_sdpa_backward", mutates_args=(), device_types="cpu")
def by_example_sdpa_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             position_ids: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float,
                             fp32_below: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `by_example_sdpa` from its kept output and log-sum-exp (an example it ran in another dtype
    than `out`'s is run again for them), through the kernel's backward."""
    grads = [t.new_zeros(t.shape) for t in (query, key, value)]  # contiguous, as the fake ones
    for a, b, q, k, v in _pieces(query, key, value, position_ids, fp32_below):
        if q.dtype == out.dtype:
            o, m = out[:, :, a:b], lse[:, :, a:b]
        else:
            o, m = _FLASH(q, k, v, 0.0, True, scale=scale)
        parts = _FLASH_BACKWARD(grad[:, :, a:b].to(q.dtype), q, k, v, o, m, 0.0, True, scale=scale)
        for whole, part in zip(grads, parts):
            whole[:, :, a:b] = part
    return grads[0], grads[1], grads[2]


@by_example_sdpa.register_fake
def _(query, key, value, position_ids, scale, fp32_below):
    # contiguous, as the examples' outputs are concatenated
    return query.new_empty(query.shape), query.new_empty(query.shape[:-1], dtype=torch.float32)


@by_example_sdpa_backward.register_fake
def _(grad, query, key, value, position_ids, out, lse, scale, fp32_below):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, position_ids, ctx.scale, ctx.fp32_below = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(query, key, value, position_ids, out, lse)


def _backward(ctx, grad: torch.Tensor, _grad_lse: torch.Tensor | None) -> tuple:
    query, key, value, position_ids, out, lse = ctx.saved_tensors
    gq, gk, gv = by_example_sdpa_backward(grad.contiguous(), query, key, value, position_ids, out, lse, ctx.scale,
                                          ctx.fp32_below)
    return gq, gk, gv, None, None, None


by_example_sdpa.register_autograd(_backward, setup_context=_setup_context)


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
