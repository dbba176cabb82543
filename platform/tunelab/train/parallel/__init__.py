"""What the training loop steps: one process, or 3D parallelism, behind one small interface.

    layout = setup(cell.parallel)                       # process group + (pp, dp, tp) DeviceMesh (tunelab.runtime)
    stepper = prepare(model, build_optimizer, cell, layout, precision)   # (weights=: a meta-device model, deferred.py)
    loss, grad_norm = stepper.train_step(micro_batches, n_items, step)
    stepper.save(dir) / stepper.load(dir)               # a checkpoint folder's model and optimizer part
    model = stepper.unwrap()                            # full weights on the main process

One plain process is `LocalStepper` (local.py). Engines, by `parallel.backend` (tunelab.registries.ENGINES):
`native` (FSDP2 + tensor parallel + pipeline stages, native.py) and `deepspeed` (ZeRO, ds.py).
docs/parallelism.md explains the layouts.
"""

from __future__ import annotations

__all__ = ["ENGINES", "Layout", "Stepper", "enable_gradient_checkpointing", "init_mode", "load_partitioned",
           "prepare", "setup", "with_adapters"]

# Loaded on first use (PEP 562): `exp memory` imports parallel/memory.py, which needs neither torch nor the
# engines, and every `exp` command registers it at start-up.
_WHERE = {"ENGINES": "tunelab.registries", "Layout": "tunelab.runtime", "setup": "tunelab.runtime",
          "Stepper": "tunelab.train.parallel.stepper", "prepare": "tunelab.train.parallel.steppers",
          "enable_gradient_checkpointing": "tunelab.train.parallel.steppers",
          "init_mode": "tunelab.train.parallel.steppers", "with_adapters": "tunelab.train.parallel.deferred",
          "load_partitioned": "tunelab.train.parallel.ds"}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'tunelab.train.parallel' has no attribute {name!r}")
