"""The DeepSpeed engine: ZeRO 1/2/3 data parallelism, CPU offload, bf16.

Optimizers with a step (AdamW, LoRA's, ...) are handed to DeepSpeed, which wraps them in its ZeRO
optimizer. LOMO/AdaLomo update inside backward and are not: see ds_fused.py for what each stage is then.

Under ZeRO-3 the model is built partitioned (`load_partitioned`: `deepspeed.zero.Init`, each module's
weights split across the ranks as soon as it is constructed) and each rank reads its own partition of every
weight from the checkpoint files, so no process ever holds the whole model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tunelab.machine.runtime import Layout
from tunelab.train.data import label_tokens
from tunelab.train.loss import root_forward_loss
from tunelab.train.parallel.anatomy import causal_lm
from tunelab.train.parallel.ds_fused import FusedEngine, half_of, zero3_buckets
from tunelab.train.parallel.stepper import Stepper, rows_for, skeleton


def ds_config(cell, layout: Layout, hidden: int | None = None, dtype: torch.dtype | None = None) -> dict:
    """The engine's configuration; `hidden` (the model's hidden size) sizes ZeRO-3's buffers, `dtype` (the
    weights') says bf16 or fp16 mode."""
    p, t = cell.parallel, cell.train
    zero: dict = {"stage": p.zero}
    if p.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if p.zero == 3:
            zero["offload_param"] = {"device": "cpu"}
    if p.zero == 3 and hidden:
        zero.update(zero3_buckets(hidden))
    return {
        "train_micro_batch_size_per_gpu": max(1, t.batch_size // layout.dp),
        "gradient_accumulation_steps": t.grad_accum,
        # DeepSpeed clips at 1.0 unless told: say what the cell says (0 = off).
        "gradient_clipping": t.max_grad_norm or 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": half_of(cell, dtype) == "bf16"},
        "fp16": {"enabled": half_of(cell, dtype) == "fp16"},
        # tunelab's own optimizers (torch AdamW, ...) are used, offloaded or not.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def load_partitioned(model_cfg, rt, cell):
    """The model built under `deepspeed.zero.Init` (ZeRO-3): each module's weights are partitioned over the
    ranks the moment it is constructed (its random init is overwritten); then every rank copies its own
    range of each flattened weight from the checkpoint files into its partition."""
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from tunelab.models import loading

    folder = loading.folder(model_cfg)
    config = AutoConfig.from_pretrained(folder)
    # Import the model's module first: zero.Init's patched tensor constructors break transformers' imports.
    MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    # zero.Init reads the stage, the parameters' offload and the dtype (from the config: its `dtype` argument
    # turns into bf16 on a CPU, deepspeed 0.19.8), which fused_config sets alike. No random init (transformers'
    # own switch for this case): the partitions are filled from the files below, and transformers' init would
    # index into the partitioned (empty) tensors.
    init_cfg = ds_config(cell, rt.layout, config.hidden_size, rt.dtype)
    with deepspeed.zero.Init(config_dict_or_path=init_cfg), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=rt.dtype, attn_implementation=rt.attn)
    model.tie_weights()  # no_init_weights skips the tying too
    weights = loading.Weights(folder)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in weights:
                raise RuntimeError(f"the checkpoint in {folder} has no weight {name!r}")
            part = p.ds_tensor.numel()
            start = part * dist.get_rank(group=p.ds_process_group)
            end = min(start + part, p.ds_numel)
            if start < end:
                p.ds_tensor.view(-1)[:end - start].copy_(weights.read_flat(name, start, end))
    return model.eval()


class DeepSpeedStepper(Stepper):
    def __init__(self, model: Any, optim_builder, cell, layout: Layout, weights=None):
        import deepspeed

        if weights is not None:
            raise ValueError("DeepSpeed builds a partitioned model at load (load_partitioned), not a deferred one")
        self.layout, self.cell = layout, cell
        self._skeleton = skeleton(model)
        if cell.parallel.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.optimizer = optim_builder([p for p in model.parameters() if p.requires_grad])
        self.fused = None
        hidden = getattr(causal_lm(model).config, "hidden_size", None)
        dtype = next(model.parameters()).dtype
        if hasattr(self.optimizer, "fused_step"):
            self.fused = FusedEngine(model, self.optimizer, cell, layout, hidden, dtype)
            self.engine = self.fused.engine
        else:
            self.engine, *_ = deepspeed.initialize(model=model, optimizer=self.optimizer,
                                                   config=ds_config(cell, layout, hidden, dtype))
        self.gas = cell.train.grad_accum

    def train_step(self, micro_batches, n_items, step=0):
        if self.fused:
            fused_loss, norm = self.fused.train_step(micro_batches, n_items)
            return self._sum(fused_loss, "dp"), norm
        if len(micro_batches) != self.gas:
            raise ValueError(f"DeepSpeed was configured for {self.gas} micro-batches per step, "
                             f"got {len(micro_batches)}")
        self.engine.train()
        total = 0.0
        n = torch.tensor(n_items, device=self.layout.device)
        for mb in micro_batches:
            loss = root_forward_loss(self.engine, rows_for(mb, self.layout), n, inner=self.engine.module)
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
        loss = float(root_forward_loss(self.engine, b, torch.tensor(1, device=self.layout.device),
                                       inner=self.engine.module))
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
        """Under ZeRO-3 one parameter is gathered at a time and only the main process keeps it."""
        import deepspeed

        module = self.engine.module
        zero3 = self.cell.parallel.zero == 3
        if zero3:  # weights a forward prefetched for a module that never ran are still in flight
            self.engine.empty_partition_cache()
        shared: dict[int, tuple[torch.Tensor, list[str]]] = {}  # a tied weight has several names
        for name, p in module.named_parameters(remove_duplicate=False):
            shared.setdefault(id(p), (p, []))[1].append(name)
        full: dict = {}
        for p, names in shared.values():
            with deepspeed.zero.GatheredParameters([p], enabled=zero3):
                if self.layout.is_main:
                    whole = p.detach().cpu().clone()
                    full.update(dict.fromkeys(names, whole))
        if self.layout.is_main:  # persistent buffers
            full.update({k: v.detach().cpu().clone() for k, v in module.state_dict().items() if k not in full})
        return self._assemble(full if self.layout.is_main else None)
