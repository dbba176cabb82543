"""prepare(): the Stepper a cell's layout needs (see the package docstring)."""

from __future__ import annotations

from tunelab.errors import UserError
from tunelab.plan.parallel import check_layout, uses_engine
from tunelab.registries import ENGINES
from tunelab.runtime import Layout
from tunelab.train.parallel.stepper import Stepper


def enable_gradient_checkpointing(model) -> None:
    # Non-reentrant checkpointing works when the inputs need no grad (frozen embeddings under PEFT).
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name for it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def prepare(model, optim_builder, cell, layout: Layout, precision: str = "fp32") -> Stepper:
    """Wrap `model` for the layout and build its optimizer with optim_builder(trainable parameters), given as
    (name, parameter) pairs to the one-process stepper and as parameters to the engines.

    `model` must be the same (same weights) on every rank: build it from the same seed or checkpoint.
    `precision` is the one-process step's autocast; engines run the model in its own dtype.
    """
    try:
        check_layout(cell)
    except ValueError as e:
        raise UserError(str(e), key="parallel") from None
    if cell.train.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if not (layout.distributed or uses_engine(cell)):
        from tunelab.train.parallel.local import LocalStepper

        return LocalStepper(model, optim_builder, cell, layout, precision)
    return ENGINES[cell.parallel.backend].stepper.load()(model, optim_builder, cell, layout)
