"""LOMO, LOw-Memory Optimization (Lv et al. 2023, arXiv 2306.09782): plain SGD fused into backward.

No optimizer state at all; each parameter is updated as soon as its gradient is complete and the
gradient is freed (see fused.py). Stability as in the paper: optional global gradient-norm clipping with
two backward passes. The paper's dynamic loss scaling exists for fp16 weights only; tunelab trains in
fp32 or bf16 (fp16 is refused at plan time), so there is none here.
"""

from __future__ import annotations

import torch

from tunelab.optimizers.fused import FusedOptimizer


class Lomo(FusedOptimizer):
    """p <- p * (1 - lr * weight_decay) - lr * clip(grad), computed in fp32 whatever the weights' dtype."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.0,
                 clip_grad_norm: float | None = None, clip_grad_value: float | None = None):
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay), clip_grad_norm, clip_grad_value)

    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        p32 = p if p.dtype == torch.float32 else p.to(torch.float32)
        if wd:
            p32.mul_(1.0 - lr * wd)
        p32.add_(grad, alpha=-lr)
        if p32 is not p:
            p.copy_(p32)
