"""Lion, EvoLved Sign Momentum (Chen et al. 2023, arXiv 2302.06675, Program 1).

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g

One state tensor per parameter (half of AdamW's). Every coordinate moves by exactly lr per step, so Lion
wants a learning rate 3-10x smaller than AdamW's and a weight decay 3-10x larger (the paper's advice).
"""

from __future__ import annotations

import torch

from tunelab.optimizers.closure import evaluate


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0):
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate(closure)
        for group in self.param_groups:
            lr, wd, (beta1, beta2) = group["lr"], group["weight_decay"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                direction = (m * beta1).add_(p.grad, alpha=1.0 - beta1).sign_()
                if wd:
                    p.mul_(1.0 - lr * wd)
                p.add_(direction, alpha=-lr)
                m.mul_(beta2).add_(p.grad, alpha=1.0 - beta2)
        return loss
