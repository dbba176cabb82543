"""The training core: optimizers, PEFT, the loop and its metrics.

`train.run` and `train.TrainResult` are loaded on first use (PEP 562), so importing a light submodule
(the memory model behind `exp memory`) does not import torch and the loop.
"""

from __future__ import annotations

__all__ = ["TrainResult", "run"]


def __getattr__(name: str):
    if name in __all__:
        from tunelab.train import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'tunelab.train' has no attribute {name!r}")
