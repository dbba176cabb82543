"""The training core: optimizers, PEFT, the loop and its metrics."""

from tunelab.train.loop import TrainResult, run

__all__ = ["TrainResult", "run"]
