"""AdaLomo (Lv et al. 2023, arXiv 2310.10195): LOMO with an adaptive, factored learning rate.

The second moment of a matrix gradient is kept Adafactor-style as one row vector and one column vector
(O(n + m) memory instead of O(n * m)); vectors keep a full second moment. Each parameter's update is then
normalized by its RMS (grouped update normalization: divided by max(1, RMS / clip_threshold)) and scaled
by the parameter's own RMS, so one learning rate suits weights of every size. Runs inside backward like
LOMO (fused.py), with the same optional global gradient-norm clipping.
"""

from __future__ import annotations

import math

import torch

from tunelab.optimizers.fused import FusedOptimizer


def _rms(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t) / math.sqrt(t.numel())


def _mean_sq(t: torch.Tensor, dim: int) -> torch.Tensor:
    # Out of place: under FSDP2 the norm is a partial DTensor, which refuses in-place ops.
    return torch.linalg.vector_norm(t, dim=dim).square() / t.shape[dim]


class AdaLomo(FusedOptimizer):
    """eps = (added to grad^2, floor of the parameter RMS); decay_rate: beta2_t = 1 - t^decay_rate."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.0,
                 eps: tuple[float, float] = (1e-30, 1e-3), clip_threshold: float = 1.0,
                 decay_rate: float = -0.8, clip_grad_norm: float | None = None,
                 clip_grad_value: float | None = None):
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if decay_rate >= 0:
            raise ValueError(f"decay_rate must be negative (beta2_t = 1 - t^decay_rate), got {decay_rate}")
        defaults = dict(lr=lr, weight_decay=weight_decay, eps=tuple(eps), clip_threshold=clip_threshold,
                        decay_rate=decay_rate)
        super().__init__(params, defaults, clip_grad_norm, clip_grad_value)

    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        factored = grad.dim() >= 2
        if not state:
            state["step"] = 0
            if factored:  # statistics over the last two dims, as Adafactor does
                state["exp_avg_sq_row"] = grad.new_zeros(grad.shape[:-1])
                state["exp_avg_sq_col"] = grad.new_zeros(grad.shape[:-2] + grad.shape[-1:])
            else:
                state["exp_avg_sq"] = torch.zeros_like(grad)
        state["step"] += 1
        beta2 = 1.0 - state["step"] ** group["decay_rate"]  # 0 at step 1: the first estimate is grad^2
        eps0, eps1 = group["eps"]

        # `grad` is ours (the hook detached it from the parameter), so the update is built in its memory:
        # for fp32 weights no parameter-sized temporary is allocated at all.
        if factored:
            row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            # mean(g^2 + eps) along a dim, from a norm: no g^2 tensor of the parameter's size
            row.mul_(beta2).add_(_mean_sq(grad, -1).add_(eps0), alpha=1.0 - beta2)
            col.mul_(beta2).add_(_mean_sq(grad, -2).add_(eps0), alpha=1.0 - beta2)
            r = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
            update = grad.mul_(r).mul_(col.unsqueeze(-2).rsqrt())
        else:
            v = state["exp_avg_sq"]
            v.mul_(beta2).add_(grad.square().add_(eps0), alpha=1.0 - beta2)
            update = grad.mul_(v.rsqrt())
        update.div_((_rms(update) / group["clip_threshold"]).clamp_(min=1.0))

        p32 = p if p.dtype == torch.float32 else p.to(torch.float32)
        lr = group["lr"] * torch.clamp(_rms(p32), min=eps1)  # a 0-d tensor: no device sync
        if group["weight_decay"]:
            p32.mul_(1.0 - lr * group["weight_decay"])
        p32.sub_(update.mul_(lr))
        if p32 is not p:
            p.copy_(p32)
