"""3D parallelism behind one small interface for the training loop.

    layout = setup(cell.parallel)                       # process group + (pp, dp, tp) DeviceMesh
    stepper = prepare(model, build_optimizer, cell, layout)
    loss, grad_norm = stepper.train_step(micro_batches, n_items)
    stepper.save(dir) / stepper.load(dir)               # torch distributed checkpoint (native)
    model = stepper.unwrap()                            # full weights on the main process

Engines: `native` (FSDP2 + tensor parallel + pipeline stages, see native.py) and `deepspeed`
(ZeRO, see ds.py). docs/parallelism.md explains the layouts.
"""

from __future__ import annotations

from tunelab.train.parallel.layout import Layout, setup
from tunelab.train.parallel.stepper import Stepper


def _native(model, optim_builder, cell, layout):
    from tunelab.train.parallel.native import NativeStepper

    return NativeStepper(model, optim_builder, cell, layout)


def _deepspeed(model, optim_builder, cell, layout):
    from tunelab.train.parallel.ds import DeepSpeedStepper

    return DeepSpeedStepper(model, optim_builder, cell, layout)


ENGINES = {"native": _native, "deepspeed": _deepspeed}


def prepare(model, optim_builder, cell, layout: Layout) -> Stepper:
    """Wrap `model` for the layout and build its optimizer with optim_builder(trainable params).

    `model` must be the same (same weights) on every rank: build it from the same seed or checkpoint.
    """
    from tunelab.errors import UserError
    from tunelab.train.parallel.validate import check_cell

    try:
        check_cell(cell)
    except ValueError as e:
        raise UserError(str(e), key="parallel") from None
    return ENGINES[cell.parallel.backend](model, optim_builder, cell, layout)


__all__ = ["Layout", "Stepper", "prepare", "setup", "ENGINES"]
