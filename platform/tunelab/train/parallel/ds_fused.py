"""LOMO/AdaLomo under the DeepSpeed backend: the engine owns the model, the optimizer owns backward.

A fused optimizer (optimizers/fused.py) updates each parameter in a post-accumulate-grad hook the
moment its gradient is complete, and frees that gradient. Here each hook first sums that one gradient
over the data-parallel ranks (each rank's loss is already its share of the step's token-normalized loss,
so the sum is the step's gradient, identical on every rank); the optimizer then adds it to the global
norm and updates, as on one process. DeepSpeed's own gradient reduction and optimizer step never run.

What each ZeRO stage means here (measured with deepspeed 0.19.8):
- ZeRO-1/2 partition optimizer state and gradients. LOMO has no state, AdaLomo only O(rows + cols) per
  matrix, and neither ever holds the model's gradients as a set, so there is nothing to partition; and
  DeepSpeed refuses ZeRO-1/2 without an optimizer to wrap. The engine is therefore built at stage 0,
  without an optimizer: for these optimizers ZeRO-1 and ZeRO-2 are plain data parallelism (the engine
  broadcasts rank 0's weights at start, the hooks reduce gradients). `cpu_offload` there would move
  optimizer state, which these optimizers (nearly) lack, so validate.py refuses it.
- ZeRO-3 partitions the parameters (DeepSpeed's ZeRO-Offload module hooks, which gather each module's
  weights around its forward and backward). A hook fires while its parameter is still gathered and its
  `.grad` is the full local gradient; after the reduction every rank holds the same full gradient and the
  same gathered weight. AdaLomo's factored statistics need that full 2-D gradient, and its step size the
  RMS of the whole weight, so each rank applies the optimizer's own update to the gathered weight (the
  same numbers on every rank) and writes its slice back into its partition (`ds_tensor`), which the next
  gather reads. Persistent small parameters, which ZeRO-3 keeps gathered, are updated in place too.
  `cpu_offload` keeps the partitions in CPU memory (offload_param). AdaLomo's statistics are replicated.
- ZeRO-3's gather hooks are armed once per forward, so a second backward over a retained graph finds
  the weights released. With global-norm clipping the norm pass and the update pass therefore each run
  their own forward (one extra forward per step, fewer activations held); the weights do not change
  between the two, so the loss and gradients are those of one forward.

The forward goes through `engine.module`: `engine(...)` arms hooks that refuse a backward the engine
did not start, and `engine.backward` would run DeepSpeed's gradient reduction on gradients already freed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tunelab.machine.runtime import Layout
from tunelab.optimizers.fused import EngineHooks
from tunelab.train.loss import root_forward_loss
from tunelab.train.parallel.stepper import rows_for


class ZeroHooks(EngineHooks):
    """Around each update: the gradient summed over `group` (None: one rank); under ZeRO-3 (its parameter
    manager `zero3`), the updated gathered weight written into this rank's partition."""

    def __init__(self, group, zero3=None):
        self.group, self.zero3 = group, zero3
        self.reforward = zero3 is not None  # ZeRO-3's gather hooks serve one backward per forward

    def before(self, p: Any) -> None:  # a ZeRO-3 parameter carries ds_* attributes
        if self.zero3 is not None and p.data.numel() != p.ds_numel:
            raise RuntimeError(f"ZeRO-3 parameter {p.ds_id} was released before its gradient was complete; "
                               "LOMO/AdaLomo need it gathered there")
        if self.group is not None:
            # In the parameter's dtype, as DeepSpeed communicates gradients by default.
            dist.all_reduce(p.grad, group=self.group)

    def after(self, p: Any) -> None:
        if self.zero3 is None:
            return
        part = p.ds_tensor.numel()
        start = part * dist.get_rank(group=p.ds_process_group)
        end = min(start + part, p.ds_numel)
        if start < end:
            p.ds_tensor.view(-1)[:end - start].copy_(p.data.view(-1)[start:end])

    def after_backward(self) -> None:
        # What ZeRO-3's own optimizer runs after each backward; without it the embedding (its input needs
        # no gradient, so its post-backward hook never fires) stays gathered and marked in use.
        if self.zero3 is not None:
            self.zero3.release_backward_leftovers()


def zero3_buckets(hidden: int) -> dict:
    """ZeRO-3's buffers sized by the model (h = hidden size), so that a rank holds its partitions and little
    else. DeepSpeed's defaults suit a GPU next to a large host: a 5e8-element reduce bucket and optimizer
    sub-group (every gradient and an fp32 temporary of every partition at once, for models up to 500M
    parameters), and gathered parameters kept for reuse within 1e9 parameters (the whole model between
    forward and backward). Buckets as the transformers integration sizes its "auto" values (h^2); gathered
    parameters released after use; the optimizer steps over sub-groups of 10 h^2 values."""
    return {"reduce_bucket_size": hidden * hidden, "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden, "stage3_max_reuse_distance": 0,
            "stage3_max_live_parameters": 10 * hidden * hidden, "sub_group_size": 10 * hidden * hidden}


def half_of(cell, dtype: torch.dtype | None) -> str | None:
    """"bf16", "fp16" or None: the weights' dtype when known (an "auto" dtype resolves to bf16 on a GPU), else
    the cell's."""
    if dtype is not None:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    return {"bfloat16": "bf16", "float16": "fp16"}.get(cell.model.dtype)


def fused_config(cell, layout: Layout, hidden: int | None = None, dtype: torch.dtype | None = None) -> dict:
    p = cell.parallel
    zero: dict = {"stage": 3 if p.zero == 3 else 0}
    if p.zero == 3 and p.cpu_offload:
        zero["offload_param"] = {"device": "cpu"}
    if p.zero == 3 and hidden:
        zero.update(zero3_buckets(hidden))
    half = half_of(cell, dtype)
    return {
        "train_micro_batch_size_per_gpu": max(1, cell.train.batch_size // layout.dp),
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # the fused optimizer clips with its own global norm
        "zero_optimization": zero,
        # At stage 0 DeepSpeed's bf16/fp16 mode would wrap a master-weight optimizer around nothing; the
        # model already is in its dtype. ZeRO-3 partitions in the dtype it is told.
        "bf16": {"enabled": half == "bf16" and p.zero == 3},
        "fp16": {"enabled": half == "fp16" and p.zero == 3},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class FusedEngine:
    """The DeepSpeed engine around `model` and the fused optimizer's step over it."""

    def __init__(self, model, optimizer, cell, layout: Layout, hidden: int | None = None,
                 dtype: torch.dtype | None = None):
        import deepspeed

        self.layout, self.zero3 = layout, cell.parallel.zero == 3
        self.engine, *_ = deepspeed.initialize(model=model, config=fused_config(cell, layout, hidden, dtype))
        group = layout.group("dp") if layout.dp > 1 else None
        optimizer.engine_hooks = ZeroHooks(group, self.engine.optimizer if self.zero3 else None)
        self.optimizer = optimizer

    def train_step(self, micro_batches, n_items) -> tuple[float, float]:
        """This rank's loss and the global gradient norm; all micro-batches in one graph, as on one process."""
        self.engine.train()
        n = torch.tensor(n_items, device=self.layout.device)

        def closure():
            losses = [root_forward_loss(self.engine.module, rows_for(mb, self.layout), n) for mb in micro_batches]
            return torch.stack(losses).sum()

        return self.optimizer.fused_step(closure)

    # Full weights and the optimizer's state (replicated: every rank computed it from the same
    # gradients), written by the main rank; any dp size can resume from them.
    def _params(self):
        return [(n, p) for n, p in self.engine.module.named_parameters()]

    def save(self, path) -> None:
        import deepspeed

        path = Path(path)
        weights = {}
        if self.zero3:  # weights a forward prefetched for a module that never ran are still in flight
            self.engine.empty_partition_cache()
        for name, p in self._params():  # one parameter gathered at a time
            with deepspeed.zero.GatheredParameters([p], enabled=self.zero3):
                if self.layout.is_main:
                    weights[name] = p.detach().cpu().clone()
        if self.layout.is_main:
            path.mkdir(parents=True, exist_ok=True)
            torch.save(weights, path / "weights.pt")
            torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
        dist.barrier()

    @torch.no_grad()
    def load(self, path) -> None:
        import deepspeed

        path = Path(path)
        weights = torch.load(path / "weights.pt", map_location="cpu", weights_only=True)
        for name, p in self._params():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0, enabled=self.zero3):
                p.copy_(weights[name])
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
