"""SDPA under bf16 autocast on CPU: attention over fewer than SHORT_KEYS keys runs in fp32.

Autocast runs `scaled_dot_product_attention` in bf16 on a CPU, and there torch's bf16 kernel is slower than
its fp32 one on short rows, backward above all. Measured on an Intel Xeon with AMX (torch 2.13, one thread,
4 rows x 9 heads x 64 dims, forward and backward, the fp32 figure including the casts of q, k, v and the
output): 7.6-8.2 against 2.8-3.1 ms at 64 keys, 19.3-21.7 against 9.0-9.7 ms at 128, level at 256 (1.00-1.06),
bf16 faster from 512 (benchmarks/sdpa_cpu.py). Instruction-tuning rows are mostly of a few hundred tokens
or less, and packed rows are attended example by example (train/segments.py), so most attention of a CPU bf16
step is short: a SmolLM2-135M step on the arithmetic recipe trains 1.21-1.39x as many tokens a second
(benchmarks/README.md). In fp32 the attention is also more exact; it keeps q, k, v and its output for
backward in fp32 instead of bf16 (a little more activation memory).

While a one-process CPU step trains in bf16, the model's attention implementation is this module's `NAME`:
transformers' own SDPA function (with SDPA's masks), given fp32 inputs when the keys are short. `usable(model)`
checks once per model, on a short padded input in fp32, that the swap gives the model's own logits (its
attention goes through transformers' attention interface and its masks are SDPA's); otherwise nothing changes.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from tunelab.train.attention_swap import probe_ids, swapped, verdict

NAME = "tunelab_cpu_sdpa"
SHORT_KEYS = 256  # below it fp32 is faster on the CPU measured above; from 512 keys bf16 is


def sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' SDPA attention; in fp32, its output in autocast's dtype, when a CPU autocasts to a half
    dtype and the keys are fewer than SHORT_KEYS."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    device = query.device.type
    if device != "cpu" or not torch.is_autocast_enabled(device) or key.shape[-2] >= SHORT_KEYS:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    half = torch.get_autocast_dtype(device)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    with torch.autocast(device, enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                              **kwargs)
    return out.to(half), weights


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def attending(model: Any) -> contextlib.AbstractContextManager:
    """The model's attention is `NAME` inside; restored on exit."""
    _register()
    return swapped(model, NAME)


def usable(model: Any) -> bool:
    """Whether `model`'s attention may be `NAME` (see the module docstring)."""
    return verdict(model, NAME, _check)


def _check(model: Any, config: Any) -> bool:
    ids = probe_ids(config, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0  # a padded row: the masks must be SDPA's (right-padded: no query sees no key at all)
    own = model(input_ids=ids, attention_mask=mask).logits
    with attending(model):
        swapped_logits = model(input_ids=ids, attention_mask=mask).logits
    return bool(torch.equal(own, swapped_logits))
