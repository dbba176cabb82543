"""Builds the optimizer a cell names: a registered name (tunelab.registries.OPTIMIZERS), any
`torch.optim.Name`, or any `package.module:Class`, called as Class(params, lr=optim.lr,
weight_decay=optim.weight_decay, **optim.kwargs). The name and the arguments were checked at plan time
(tunelab.plan.optim, with the registry's facts); docs/optimizers.md says where each registered optimizer comes from.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tunelab.config import OptimCfg
from tunelab.registries import OPTIMIZERS, accepts
from tunelab.registries import optimizer_spec as spec

__all__ = ["OPTIMIZERS", "build", "spec"]


def build(params: Iterable, cfg: OptimCfg, *, max_grad_norm: float | None = None) -> torch.optim.Optimizer:
    """The optimizer for `params` (tensors, or (name, tensor) pairs) as `cfg` (an OptimCfg) says.

    max_grad_norm (train.max_grad_norm) becomes LOMO/AdaLomo's clip_grad_norm unless optim.kwargs sets it:
    those clip inside their own backward passes, the loop cannot do it for them.
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
    accepted, open_ended = accepts(factory)
    if cfg.weight_decay or open_ended or "weight_decay" in accepted:
        kwargs["weight_decay"] = cfg.weight_decay
    return factory(items, lr=cfg.lr, **kwargs)
