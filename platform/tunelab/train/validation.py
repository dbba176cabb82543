"""Validation loss: the token-weighted mean loss over a validation set, in batches of examples.

The one owner of the number. Training measures it periodically (train.eval_every) and once at the end when
the cell's evaluation asks for `val_loss`, through its stepper (every rank takes part under an engine);
evaluation measures it on a model alone (an evaluation of saved weights) through the same function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tunelab.train.data import loader
from tunelab.train.modes import evaluating
from tunelab.train.parallel.local import eval_loss

EvalLoss = Callable[[dict], tuple[float, int]]  # batch -> (summed token loss, label tokens)


@dataclass(frozen=True)
class Validation:
    """How training measures validation loss (from the cell's eval section: batch_size, val_batches)."""

    batch_size: int = 8
    max_batches: int | None = None  # null: the whole set
    final: bool = False  # also once at the end (the val_loss task), so evaluation need not measure it again

    @classmethod
    def of(cls, eval_cfg) -> Validation:
        return cls(eval_cfg.batch_size, eval_cfg.val_batches, "val_loss" in eval_cfg.tasks)

    def settings(self) -> dict:
        """What decides the value (train/summary.json keeps it beside val_loss)."""
        return {"batch_size": self.batch_size, "max_batches": self.max_batches}


def validation_loss(eval_loss: EvalLoss, ds, pad_id: int, batch_size: int, max_batches: int | None = None,
                    attn: str = "sdpa") -> float:
    total, count = 0.0, 0
    for i, batch in enumerate(loader(ds, batch_size, pad_id, shuffle=False, attn=attn)):
        if max_batches is not None and i >= max_batches:
            break
        loss, n = eval_loss(batch)
        total, count = total + loss, count + n
    return total / max(count, 1)


def model_validation_loss(model, ds, pad_id: int, batch_size: int, max_batches: int | None = None,
                          precision: str = "fp32") -> float:
    """The same mean for a model without a stepper."""
    attn = getattr(model.config, "_attn_implementation", "sdpa")
    with evaluating(model):
        return validation_loss(lambda b: eval_loss(model, b, precision), ds, pad_id, batch_size, max_batches, attn)
