"""The DeepSpeed engine: ZeRO 1/2/3 data parallelism, CPU offload, bf16.

Optimizers with a step (AdamW, LoRA's, ...) are handed to DeepSpeed, which wraps them in its ZeRO
optimizer. LOMO/AdaLomo update inside backward and are not: see ds_fused.py for what each stage is then.
"""

from __future__ import annotations

import torch
from torch import nn

from tunelab.runtime import Layout
from tunelab.train.data import label_tokens
from tunelab.train.parallel.stepper import Stepper, rows_for, skeleton


def ds_config(cell, layout: Layout) -> dict:
    p, t = cell.parallel, cell.train
    zero: dict = {"stage": p.zero}
    if p.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if p.zero == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": max(1, t.batch_size // layout.dp),
        "gradient_accumulation_steps": t.grad_accum,
        # DeepSpeed clips at 1.0 unless told: say what the cell says (0 = off).
        "gradient_clipping": t.max_grad_norm or 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": cell.model.dtype == "bfloat16"},
        "fp16": {"enabled": cell.model.dtype == "float16"},
        # tunelab's own optimizers (torch AdamW, ...) are used, offloaded or not.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class DeepSpeedStepper(Stepper):
    def __init__(self, model: nn.Module, optim_builder, cell, layout: Layout):
        import deepspeed

        self.layout, self.cell = layout, cell
        self._skeleton = skeleton(model)
        if cell.parallel.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.optimizer = optim_builder([p for p in model.parameters() if p.requires_grad])
        self.fused = None
        if hasattr(self.optimizer, "fused_step"):
            from tunelab.train.parallel.ds_fused import FusedEngine

            self.fused = FusedEngine(model, self.optimizer, cell, layout)
            self.engine = self.fused.engine
        else:
            self.engine, *_ = deepspeed.initialize(model=model, optimizer=self.optimizer,
                                                   config=ds_config(cell, layout))
        self.gas = cell.train.grad_accum

    def train_step(self, micro_batches, n_items, step=0):
        if self.fused:
            loss, norm = self.fused.train_step(micro_batches, n_items)
            return self._sum(loss, "dp"), norm
        if len(micro_batches) != self.gas:
            raise ValueError(f"DeepSpeed was configured for {self.gas} micro-batches per step, "
                             f"got {len(micro_batches)}")
        self.engine.train()
        total = 0.0
        n = torch.tensor(n_items, device=self.layout.device)
        for mb in micro_batches:
            loss = self.engine(**rows_for(mb, self.layout), num_items_in_batch=n).loss
            # DeepSpeed averages gradients over ranks and divides the loss by the accumulation
            # steps; the loss here is already a share of the whole step's sum, so undo both.
            self.engine.backward(loss * (self.layout.dp * self.gas))
            self.engine.step()
            total += float(loss.detach())
        norm = self.engine.get_global_grad_norm()
        return self._sum(total, "dp"), float(norm if norm is not None else float("nan"))

    @torch.no_grad()
    def eval_loss(self, batch):
        self.engine.eval()
        b = {k: v.to(self.layout.device) for k, v in batch.items()}
        loss = float(self.engine(**b, num_items_in_batch=torch.tensor(1, device=self.layout.device)).loss)
        self.engine.train()
        return loss, label_tokens(batch)

    # DeepSpeed keeps ZeRO's flat partitions in its own checkpoint format; resuming needs the same layout.
    # A fused optimizer has no ZeRO optimizer to save: ds_fused writes full weights and its state.
    def save(self, path) -> None:
        if self.fused:
            return self.fused.save(path)
        self.engine.save_checkpoint(str(path), tag="latest")

    def load(self, path) -> None:
        if self.fused:
            return self.fused.load(path)
        self.engine.load_checkpoint(str(path), tag="latest")

    def state_dict(self):
        raise NotImplementedError("DeepSpeed checkpoints go through save(path)/load(path)")

    def load_state_dict(self, state):
        raise NotImplementedError("DeepSpeed checkpoints go through save(path)/load(path)")

    def unwrap(self):
        import deepspeed

        module = self.engine.module
        params = list(module.parameters())
        full = None
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=self.cell.parallel.zero == 3):
            if self.layout.is_main:
                full = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        return self._assemble(full)
