"""Builds the optimizer a cell names: a registered name (tunelab.core.registries.OPTIMIZERS), any
`torch.optim.Name`, or any `package.module:Class`, called as Class(params, lr=optim.lr,
weight_decay=optim.weight_decay, **optim.kwargs). The name and the arguments were checked at plan time
(tunelab.plan.optim, with the registry's facts); docs/optimizers.md says where each registered optimizer comes from.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tunelab.core.config import OptimCfg
from tunelab.core.registries import OPTIMIZERS, accepts
from tunelab.core.registries import optimizer_spec as spec

__all__ = ["OPTIMIZERS", "build", "spec"]


def build(params: Iterable, cfg: OptimCfg, *, max_grad_norm: float | None = None,
          fused_kernel: bool = False) -> torch.optim.Optimizer:
    """The optimizer for `params` (tensors, or (name, tensor) pairs) as `cfg` (an OptimCfg) says.

    max_grad_norm (train.max_grad_norm) becomes LOMO/AdaLomo's clip_grad_norm unless optim.kwargs sets it:
    those clip inside their own backward passes, the loop cannot do it for them.
    fused_kernel: torch's Adam and AdamW run their fused kernel (`fused=True`) unless optim.kwargs chooses
    (`fused` or `foreach`); see `_fused_by_default`.
    """
    s = spec(cfg.name)
    factory = s.load()
    items = list(params)
    if not s.named:
        items = [it[1] if isinstance(it, tuple) else it for it in items]
    # YAML has lists where constructors expect tuples (betas, eps pairs).
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.kwargs.items()}
    if s.fused and max_grad_norm is not None:
        kwargs.setdefault("clip_grad_norm", max_grad_norm)
    if fused_kernel and _fused_by_default(factory, items, kwargs):
        kwargs["fused"] = True
    accepted, open_ended = accepts(factory)
    if cfg.weight_decay or open_ended or "weight_decay" in accepted:
        kwargs["weight_decay"] = cfg.weight_decay
    return factory(items, lr=cfg.lr, **kwargs)


def _fused_by_default(factory: type, items: list, kwargs: dict) -> bool:
    """Whether torch's fused Adam/AdamW kernel applies: one pass over each tensor instead of the dozen of the
    default per-tensor loop (on CPU a 135M-parameter step took 0.2 s fused, 1.0 s looped), the same update up
    to float rounding, and what transformers' Trainer uses by default since torch 2.8. Only for plain
    floating-point tensors on CPU or CUDA (not the DTensors of the parallel engines) and only when
    optim.kwargs does not choose."""
    if factory not in (torch.optim.Adam, torch.optim.AdamW) or {"fused", "foreach"} & set(kwargs):
        return False
    tensors = [it[1] if isinstance(it, tuple) else it for it in items]
    return all(type(t) is torch.nn.Parameter and t.is_floating_point() and t.device.type in ("cpu", "cuda")
               for t in tensors)
