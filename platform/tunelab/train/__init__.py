"""The training core: PEFT, building the optimizer, the loop and its metrics, and the layouts it steps on
(parallel/). The optimizer classes themselves are a layer below (tunelab.optimizers).

`train.run` and `train.TrainResult` are loaded on first use (PEP 562, through registry.Lazy), so importing a
light submodule (the memory model behind `exp memory`) does not import torch and the loop.

May import: core, folders, optimizers, plan, machine, data, models.
"""

from __future__ import annotations

from typing import Any

from tunelab.core.registry import Lazy

__all__ = ["TrainResult", "run"]


_LAZY = {"run": Lazy("tunelab.train.loop:run"), "TrainResult": Lazy("tunelab.train.loop:TrainResult")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return _LAZY[name].load()
    raise AttributeError(f"module 'tunelab.train' has no attribute {name!r}")
