"""Adan, ADAptive Nesterov momentum (Xie et al. 2022, arXiv 2208.06677, Algorithm 1).

With betas written as PyTorch does (close to 1: the paper's 1 - beta_i) and the bias corrections of the
authors' reference code:

    d = g - g_prev                      (0 at the first step)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * d
    n = b3 * n + (1 - b3) * (g + b2 * d)^2
    u = (m / (1 - b1^t) + b2 * v / (1 - b2^t)) / (sqrt(n / (1 - b3^t)) + eps)
    p = (p - lr * u) / (1 + lr * weight_decay)      (proximal decay, the paper's; no_prox: AdamW-style)

Four state tensors per parameter (m, v, n and the previous gradient).
"""

from __future__ import annotations

import torch

from tunelab.optimizers.closure import evaluate


class Adan(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float, float] = (0.98, 0.92, 0.99),
                 eps: float = 1e-8, weight_decay: float = 0.0, no_prox: bool = False):
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if len(betas) != 3 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be three numbers in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      no_prox=no_prox))

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate(closure)
        for group in self.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            b1, b2, b3 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    for key in ("exp_avg", "exp_avg_diff", "exp_avg_sq"):
                        state[key] = torch.zeros_like(p)
                    state["prev_grad"] = g.clone()
                state["step"] += 1
                t = state["step"]
                m, v, n = state["exp_avg"], state["exp_avg_diff"], state["exp_avg_sq"]
                diff = g - state["prev_grad"]
                m.mul_(b1).add_(g, alpha=1.0 - b1)
                v.mul_(b2).add_(diff, alpha=1.0 - b2)
                nesterov = diff.mul_(b2).add_(g)  # g + b2 * d, reusing diff's memory
                n.mul_(b3).addcmul_(nesterov, nesterov, value=1.0 - b3)
                denom = (n / (1.0 - b3**t)).sqrt_().add_(eps)
                update = (m / (1.0 - b1**t)).add_(v, alpha=b2 / (1.0 - b2**t)).div_(denom)
                if group["no_prox"]:
                    p.mul_(1.0 - lr * wd)
                    p.add_(update, alpha=-lr)
                else:
                    p.add_(update, alpha=-lr)
                    if wd:
                        p.div_(1.0 + lr * wd)
                state["prev_grad"].copy_(g)
        return loss

