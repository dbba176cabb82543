"""The torch.optim convention: step(closure) re-evaluates the loss with gradients enabled."""

from __future__ import annotations

import torch


def evaluate(closure):
    """The closure's loss (None without a closure); step() itself runs under no_grad."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
