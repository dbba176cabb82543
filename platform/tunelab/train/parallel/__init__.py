"""What the training loop steps: one process, or 3D parallelism, behind one small interface.

    layout = setup(cell.parallel)                       # process group + (pp, dp, tp) DeviceMesh (machine/runtime.py)
    stepper = prepare(model, build_optimizer, cell, layout, precision)   # (weights=: a meta-device model, deferred.py)
    loss, grad_norm = stepper.train_step(micro_batches, n_items, step)
    stepper.save(dir) / stepper.load(dir)               # a checkpoint folder's model and optimizer part
    model = stepper.unwrap()                            # full weights on the main process

One plain process is `LocalStepper` (local.py). Engines, by `parallel.backend` (tunelab.core.registries.ENGINES):
`native` (FSDP2 + tensor parallel + pipeline stages, native.py) and `deepspeed` (ZeRO, ds.py).
docs/parallelism.md explains the layouts.
"""

from __future__ import annotations

from typing import Any

from tunelab.core.registry import Lazy

__all__ = ["ENGINES", "Layout", "Stepper", "enable_gradient_checkpointing", "init_mode", "load_partitioned",
           "prepare", "setup", "with_adapters"]

# Loaded on first use (PEP 562, through registry.Lazy): `exp memory` imports parallel/memory.py, which needs
# neither torch nor the engines, and every `exp` command registers it at start-up.
_LAZY = {"ENGINES": Lazy("tunelab.core.registries:ENGINES"), "Layout": Lazy("tunelab.machine.runtime:Layout"),
         "setup": Lazy("tunelab.machine.runtime:setup"), "Stepper": Lazy("tunelab.train.parallel.stepper:Stepper"),
         "prepare": Lazy("tunelab.train.parallel.steppers:prepare"),
         "enable_gradient_checkpointing": Lazy("tunelab.train.parallel.steppers:enable_gradient_checkpointing"),
         "init_mode": Lazy("tunelab.train.parallel.steppers:init_mode"),
         "with_adapters": Lazy("tunelab.train.parallel.deferred:with_adapters"),
         "load_partitioned": Lazy("tunelab.train.parallel.ds:load_partitioned")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return _LAZY[name].load()
    raise AttributeError(f"module 'tunelab.train.parallel' has no attribute {name!r}")
