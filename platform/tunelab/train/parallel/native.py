"""The PyTorch-native engine, as torchtitan builds it: tensor parallel inside a stage, pipeline
stages across `pp`, FSDP2 across `dp`. With one process it is a plain training step."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from tunelab.machine.runtime import Layout
from tunelab.train.data import label_tokens
from tunelab.train.loss import exact_at_labels, root_forward_loss
from tunelab.train.parallel import grads, stages, tied, tp
from tunelab.train.parallel.anatomy import anatomy, causal_lm
from tunelab.train.parallel.deferred import Deferred, materialize
from tunelab.train.parallel.pipeline import Pipeline
from tunelab.train.parallel.stepper import Stepper, rows_for, skeleton

STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}


def _shard(module: nn.Module, a, mesh, pcfg) -> None:
    """FSDP2: each decoder layer its own unit (gathered one at a time); an untied embedding and output head
    their own units too (each as large as several layers), the rest (final norm) at the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    kw = {"mesh": mesh, "reshard_after_forward": pcfg.zero == 3,
          "offload_policy": CPUOffloadPolicy() if pcfg.cpu_offload else OffloadPolicy()}
    paths = list(a.layers) + ([] if a.tied else [a.embed, a.lm_head])
    for unit in [module.get_submodule(p) for p in paths if _has(module, p)]:
        fully_shard(unit, **kw)
    fully_shard(module, **kw)


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


class NativeStepper(Stepper):
    def __init__(self, model: Any, optim_builder, cell, layout: Layout, weights: Deferred | None = None):
        """`weights`: the model is on the meta device; each process fills its own shards once they are cut
        (deferred.py). Without it, every process holds the whole model until it is sharded."""
        self.layout, self.cell = layout, cell
        pcfg = cell.parallel
        self.max_norm = cell.train.max_grad_norm
        self._skeleton = skeleton(model) if layout.distributed else None
        self._model = model
        if pcfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        a: Any = anatomy(model) if layout.tp > 1 or layout.pp > 1 else None  # present wherever it is used
        self.pipeline = None
        if layout.pp > 1:
            v = STAGES_PER_RANK[pcfg.pp_schedule]
            ids = [layout.coord("pp") + k * layout.pp for k in range(v)]
            self.modules: list[Any] = list(stages.build(model, a, ids, layout.pp * v))
        else:
            self.modules = [model]
        if layout.tp > 1:
            decoder = a.layers[0].rsplit(".layers.", 1)[0]
            for m in self.modules:
                tp.apply(m, decoder, a.config, layout.mesh["tp"])
        # Each micro-batch loss is already a share of the whole step's (all ranks') token sum, so
        # the ranks' gradients must add up; FSDP2 averages them, so backward runs on loss x dp.
        # (Its divide factor could say the same, but gloo cannot do the pre-multiplied sum.)
        self.grad_scale = 1
        if layout.dp > 1 or pcfg.cpu_offload:
            self.grad_scale = layout.dp
            mesh = layout.mesh["dp"] if layout.distributed else None
            for m in self.modules:
                _shard(m, a or anatomy(model), mesh, pcfg)
        if weights is not None:  # before anything holds on to a parameter: to_empty may replace them
            materialize(self.modules, weights, "cpu" if pcfg.cpu_offload else layout.device)
        self.tied = tied.TiedEmbeddings(self.modules, a, layout) if layout.pp > 1 and a.tied else None
        if layout.pp > 1:
            lm = causal_lm(model)
            self.pipeline = Pipeline(self.modules, ids, layout, pcfg, lm.loss_function, lm.config.vocab_size,
                                     self.grad_scale, at_labels=exact_at_labels(model))
        unique = {id(p): p for m in self.modules for p in m.parameters() if p.requires_grad}  # tied: once
        self.params = list(unique.values())
        self.optimizer = optim_builder(self.params)

    def _loss(self, batch: dict, n_items) -> torch.Tensor:
        """The step's share of the loss, the head only where a label is and in chunks (train/loss.py,
        train/chunked.py): through the root forward, whose hooks FSDP2 needs; under tensor parallelism the
        head is replicated (tp.py splits the decoder layers only) and the body's outputs are whole tensors,
        so the same holds."""
        return root_forward_loss(self._model, batch, n_items)

    # -- training -------------------------------------------------------------------------
    def train_step(self, micro_batches, n_items, step=0):
        for m in self.modules:
            m.train()
        fused = hasattr(self.optimizer, "fused_step")
        if fused and not self.pipeline:
            return self._fused_step(micro_batches, n_items)
        total = 0.0
        for mb in micro_batches:
            b = rows_for(mb, self.layout)
            if self.pipeline:
                total += self.pipeline.step(b, n_items)
            else:
                n = torch.tensor(n_items, device=self.layout.device)
                loss = self._loss(b, n)
                (loss * self.grad_scale).backward()
                total += float(loss.detach())
        if self.tied:
            self.tied.sum_grads()
        gs = [p.grad for p in self.params if p.grad is not None]
        pp_group = self.layout.group("pp") if self.layout.pp > 1 else None
        if fused:
            # The schedule ran backward micro-batch by micro-batch: a gradient is whole only now, so
            # LOMO/AdaLomo update here, clipped by the norm over all stages, freeing each gradient as used.
            norm = float(grads.global_norm(self._for_norm(gs), pp_group, self.layout.device))
            del gs
            self.optimizer.step(grad_norm=norm)
            return self._sum(total, "dp", "pp"), norm
        norm = grads.clip_(gs, self.max_norm, pp_group, self.layout.device, norm_of=self._for_norm(gs))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self._sum(total, "dp", "pp"), norm

    def _for_norm(self, gs: list) -> list:
        return self.tied.for_norm(gs) if self.tied else gs

    def _fused_step(self, micro_batches, n_items):
        """LOMO/AdaLomo update inside backward: one graph over all micro-batches, run by the optimizer."""
        n = torch.tensor(n_items, device=self.layout.device)

        def closure():
            losses = [self._loss(rows_for(mb, self.layout), n) for mb in micro_batches]
            return torch.stack(losses).sum() * self.grad_scale

        loss, norm = self.optimizer.fused_step(closure)
        return self._sum(loss / self.grad_scale, "dp"), norm

    @torch.no_grad()
    def eval_loss(self, batch):
        for m in self.modules:
            m.eval()
        b = {k: v.to(self.layout.device) for k, v in batch.items()}
        if self.pipeline:
            loss = self._sum(self.pipeline.eval(b), "pp")
        else:
            loss = float(self._loss(b, torch.tensor(1, device=self.layout.device)))
        for m in self.modules:
            m.train()
        return loss, label_tokens(batch)

    # -- checkpoints ------------------------------------------------------------------------
    def _view(self) -> nn.Module:
        """One module holding all of this rank's parameters under their original names."""
        if len(self.modules) == 1:
            return self.modules[0]
        view = nn.Module()
        for m in self.modules:
            for path in m.paths:
                if not _has(view, path):
                    stages._graft(view, path, m.get_submodule(path))
        return view

    def state_dict(self):
        msd, osd = get_state_dict(self._view(), self.optimizer)
        if self.tied:
            osd = self.tied.rename_optim(osd, to_checkpoint=True)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state):
        osd = self.tied.rename_optim(state["optim"], to_checkpoint=False) if self.tied else state["optim"]
        set_state_dict(self._view(), self.optimizer, model_state_dict=state["model"], optim_state_dict=osd)

    def unwrap(self):
        if not self.layout.distributed:
            return self._model
        # One tensor made whole at a time, kept by one process per pipeline stage (the main process's
        # stage, or the one that sends it there): no other process ever holds more than one whole tensor.
        keep = self.layout.coord("dp") == 0 and self.layout.coord("tp") == 0
        full = {}
        for m in self.modules:
            for k, v in m.state_dict().items():
                whole = v.full_tensor() if isinstance(v, DTensor) else v.detach().clone()
                if keep:
                    full[k] = whole.detach().cpu()
                del whole
        if self.layout.pp > 1:
            parts: list[Any] | None = [None] * self.layout.pp if self.layout.coord("pp") == 0 else None
            dist.gather_object(full if keep else None, parts, group=self.layout.group("pp"), group_dst=0)
            full = {k: v for part in (parts or []) if part for k, v in part.items()}
        return self._assemble(full)
