"""SophiaG (Liu et al. 2023, arXiv 2305.14342, Algorithms 2 and 3): clipped diagonal second-order steps.

    m = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * sign(m) * min(|m| / (rho * h + eps), 1)

h is an EMA of the Gauss-Newton-Bartlett estimate of the Hessian diagonal, refreshed every k steps
(`hessian_interval`): sample labels from the model's own output distribution, take the gradient g' of the
mean loss on those sampled labels over the B label positions, h = beta2 * h + (1 - beta2) * B * g' * g'.
The training loop calls `after_step(step=, model=, batch=)` after every optimizer step; the estimate runs
on that batch when step % k == 0. Until the first estimate h is 0 and the step is sign momentum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tunelab.optimizers.closure import evaluate

IGNORE = -100  # the label of a position that is not trained on
SampledLoss = Callable[[Any, dict], tuple[torch.Tensor | None, int]]


class SophiaG(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.965, 0.99),
                 rho: float = 0.04, weight_decay: float = 0.0, eps: float = 1e-15,
                 hessian_interval: int = 10):
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if rho <= 0:
            raise ValueError(f"rho must be positive, got {rho}")
        if hessian_interval < 1:
            raise ValueError(f"hessian_interval must be >= 1, got {hessian_interval}")
        self.hessian_interval = hessian_interval
        super().__init__(params, dict(lr=lr, betas=tuple(betas), rho=rho, weight_decay=weight_decay, eps=eps))

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p)
            state["hessian"] = torch.zeros_like(p)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate(closure)
        for group in self.param_groups:
            lr, wd, rho, eps = group["lr"], group["weight_decay"], group["rho"], group["eps"]
            beta1 = group["betas"][0]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p)
                m = state["exp_avg"]
                if wd:
                    p.mul_(1.0 - lr * wd)
                m.mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
                ratio = (m.abs() / (rho * state["hessian"] + eps)).clamp_(max=1.0)
                p.addcmul_(m.sign(), ratio, value=-lr)
        return loss

    @torch.no_grad()
    def update_hessian(self, grads: list[torch.Tensor | None], batch_size: int) -> None:
        """EMA of batch_size * g * g, g being gradients of the loss on sampled labels (one per param)."""
        params = [p for g in self.param_groups for p in g["params"]]
        beta2 = {id(p): g["betas"][1] for g in self.param_groups for p in g["params"]}
        for p, grad in zip(params, grads, strict=True):
            if grad is not None:
                b = beta2[id(p)]
                self._state(p)["hessian"].mul_(b).addcmul_(grad, grad, value=(1.0 - b) * batch_size)

    def after_step(self, *, step: int, model, batch: dict, sampled_loss: SampledLoss | None = None) -> None:
        """`sampled_loss(model, batch)`: the loss on sampled labels; the trainer passes its own (tunelab's runs the
        head in chunks, train/loss.py), else the whole-logits one below."""
        if step % self.hessian_interval == 0:
            params = [p for g in self.param_groups for p in g["params"]]
            grads, n = gnb_gradients(model, batch, params, sampled_loss or sampled_loss_whole)
            if n:
                self.update_hessian(grads, n)


def sampled_loss_whole(model, batch: dict) -> tuple[torch.Tensor | None, int]:
    """(mean cross-entropy against labels sampled from the model's own predictions at the labelled positions,
    their count), from the model's whole logits."""
    labels = batch["labels"]
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    # Prompt-learning PEFT methods prepend virtual tokens to the logits: keep the real positions.
    picked = logits[:, -labels.size(1):][:, :-1][labels[:, 1:] != IGNORE].float()
    if not picked.numel():
        return None, 0
    sampled = torch.distributions.Categorical(logits=picked.detach()).sample()
    return torch.nn.functional.cross_entropy(picked, sampled), picked.shape[0]


def gnb_gradients(model, batch: dict, params: list[torch.Tensor],
                  sampled_loss: SampledLoss = sampled_loss_whole) -> tuple[list, int]:
    """Gradients of the mean loss on labels sampled from the model, over the batch's label positions.

    Returns (one gradient or None per param, B = number of positions). Uses torch.autograd.grad so the
    training gradients (.grad) are never touched.
    """
    with torch.enable_grad():
        loss, n = sampled_loss(model, batch)
        if n == 0 or loss is None:
            return [None] * len(params), 0
        trainable = [p for p in params if p.requires_grad]
        grads = iter(torch.autograd.grad(loss, trainable, allow_unused=True))
    return [next(grads) if p.requires_grad else None for p in params], n
