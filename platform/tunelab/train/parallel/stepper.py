"""What every engine offers the training loop: one optimizer step, validation loss, checkpoints."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tunelab.machine.runtime import Layout
from tunelab.train.parallel.anatomy import causal_lm


def rows_for(batch: dict, layout: Layout) -> dict:
    """This data-parallel rank's share of a global micro-batch's rows, on its device."""
    i = layout.coord("dp")
    return {k: torch.tensor_split(v, layout.dp)[i].to(layout.device) for k, v in batch.items()}


def skeleton(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters live on the meta device (no memory), to be filled with
    the gathered full weights by `unwrap`. Buffers are copied for real: non-persistent ones
    (rotary frequencies) are in no state dict. A parameter DeepSpeed's ZeRO-3 partitioned at construction
    keeps its real shape in `ds_shape`."""
    memo = {id(p): nn.Parameter(torch.empty(getattr(p, "ds_shape", p.shape), dtype=p.dtype, device="meta"),
                                requires_grad=p.requires_grad)
            for p in model.parameters()}
    return copy.deepcopy(model, memo)


class Stepper:
    """What the training loop drives: one process (local.py) or an engine (native.py, ds.py)."""

    layout: Layout
    optimizer: Any  # a torch Optimizer; LOMO/AdaLomo's also take step(grad_norm=) and fused_step(closure)
    _skeleton: Any  # the meta-device copy `unwrap` fills (engines)
    checkpoint_subdir = "engine"  # where in a checkpoint folder `save` writes (torch DCP or DeepSpeed shards)

    def train_step(self, micro_batches: list[dict], n_items: int, step: int = 0) -> tuple[float, float]:
        """Optimizer step number `step` over the global micro-batches of the step: each micro-batch's loss is
        its summed token loss / n_items (label tokens in the whole step, all ranks). Returns
        (loss, grad norm before clipping), the same on every rank."""
        raise NotImplementedError

    def eval_loss(self, batch: dict) -> tuple[float, int]:
        """(summed token loss, label tokens) of a whole batch, the same on every rank."""
        raise NotImplementedError

    def evaluating(self) -> contextlib.AbstractContextManager:
        """Around a whole validation (its eval_loss calls): one process puts its model in eval mode once for all
        its batches (train/modes.py); an engine switches its own per batch."""
        return contextlib.nullcontext()

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError

    def unwrap(self) -> nn.Module | None:
        """The whole model with full weights on the main process (None elsewhere); every rank must call it."""
        raise NotImplementedError

    def _assemble(self, full: dict | None) -> nn.Module | None:
        """The main process's whole model: the meta-device skeleton filled with the gathered weights."""
        if not self.layout.is_main:
            return None
        model = self._skeleton
        model.load_state_dict(full, strict=True, assign=True)
        if getattr(causal_lm(model).config, "tie_word_embeddings", False):
            causal_lm(model).tie_weights()
        return model.to(self.layout.device)

    def save(self, path) -> None:
        """A distributed checkpoint of model and optimizer under `path` (every rank calls it)."""
        import torch.distributed.checkpoint as dcp

        dcp.save({"train": self}, checkpoint_id=str(path))

    def load(self, path) -> None:
        """Resume from `save`'s folder; the layout that wrote it does not matter."""
        import torch.distributed.checkpoint as dcp

        dcp.load({"train": self}, checkpoint_id=str(path))

    def _sum(self, value: float, *dims: str) -> float:
        """Sum a per-rank number over mesh dims (identity for one process)."""
        t = torch.tensor(float(value), dtype=torch.float64, device=self.layout.device)
        if self.layout.distributed:
            for d in dims:
                dist.all_reduce(t, group=self.layout.group(d))
        return float(t)
