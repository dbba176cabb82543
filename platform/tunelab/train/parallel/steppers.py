"""prepare(): the Stepper a cell's layout needs (see the package docstring)."""

from __future__ import annotations

from tunelab.core.errors import UserError
from tunelab.core.layouts import check_layout
from tunelab.core.registries import ENGINES, uses_engine
from tunelab.machine.runtime import Layout
from tunelab.train import lean
from tunelab.train.chunked import set_chunk
from tunelab.train.parallel.anatomy import causal_lm
from tunelab.train.parallel.deferred import Deferred, needs_whole
from tunelab.train.parallel.stepper import Stepper


def enable_gradient_checkpointing(model) -> None:
    # Non-reentrant checkpointing works when the inputs need no grad (frozen embeddings under PEFT).
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name for it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def init_mode(cell, layout: Layout, safetensors: bool = True) -> tuple[str, str]:
    """How a cell's model is built on this layout, and why:
    "meta"  the native engine's layouts: every parameter on the meta device, each process fills only its own
            shards once they are cut (deferred.py);
    "zero3" DeepSpeed ZeRO-3: partitioned at construction (ds.load_partitioned);
    "whole" one process, DeepSpeed ZeRO-1/2 (every rank keeps whole weights anyway), a PEFT method that needs
            the whole base weights, or a checkpoint without safetensors files (nothing to read a slice of)."""
    if not layout.distributed:
        return "whole", "one process"
    p = cell.parallel
    engine = ENGINES[p.backend]
    if p.zero < engine.whole_below_zero:
        return "whole", f"ZeRO-{p.zero} keeps whole weights on every rank"
    reason = needs_whole(cell.peft.method)
    if reason:
        return "whole", reason
    if not safetensors:
        return "whole", "the checkpoint has no safetensors files to read per shard"
    return engine.sharded_build, "sharded at construction"


def prepare(model, optim_builder, cell, layout: Layout, precision: str = "fp32",
            weights: Deferred | None = None, names=None) -> Stepper:
    """Wrap `model` for the layout and build its optimizer with optim_builder(trainable parameters), given as
    (name, parameter) pairs to the one-process stepper and as parameters to the engines.

    `model` must be the same (same weights) on every rank: build it from the same seed or checkpoint, or on
    the meta device with `weights` saying where each parameter's values are (init_mode "meta").
    `precision` is the one-process step's autocast; engines run the model in its own dtype.
    `names` (one process only): parameter name -> the name its checkpoint and optimizer use (a together-group's
    member: the alone cell's names, train/members.py).
    """
    try:
        check_layout(cell)
    except ValueError as e:
        raise UserError(str(e), key="parallel") from None
    if cell.train.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    lean.apply(model)  # norms and MLPs that keep less for backward, on every layout (train/lean.py)
    head = causal_lm(model).get_output_embeddings()
    if head is not None:  # the chunk of the head's loss (train/chunked.py), read by every layout's head call
        set_chunk(head, cell.train.loss_chunk)
    if not (layout.distributed or uses_engine(cell.parallel)):
        from tunelab.train.parallel.local import LocalStepper

        stepper = LocalStepper(model, optim_builder, cell, layout, precision, names)
    else:
        if names is not None:
            raise ValueError("renamed parameters are for one process only (a together-group's member)")
        engine = ENGINES[cell.parallel.backend].stepper.load()
        stepper = engine(model, optim_builder, cell, layout, weights) if weights else engine(model, optim_builder,
                                                                                             cell, layout)
    if head is not None:  # one backward per forward, a whole gradient kept: the head's built in its forward
        set_chunk(head, cell.train.loss_chunk, early=not hasattr(stepper.optimizer, "fused_step"))
    return stepper
