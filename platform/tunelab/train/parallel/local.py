"""One process: the Stepper that runs a cell with no parallel engine, so the loop has one step path.

What only a single process can do lives here: bf16 autocast (engines run the model in its own dtype), the
output head and loss at labelled positions, in chunks, by calling the decoder body alone
(train/loss.py, train/chunked.py; the engines, whose hooks sit on the root forward, use its `root_forward_loss`),
LOMO/AdaLomo running forward and backward themselves with one gradient buffer for a tied embedding
(optimizers/tied.py), and Sophia's Hessian refresh between steps. Checkpoints are the trainable parameters
(model.pt) and the optimizer's state (optimizer.pt), in the checkpoint folder itself; `load` also reads an
engine's distributed checkpoint, saved under any layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tunelab.core.registries import optimizer_spec as optim_spec
from tunelab.machine.runtime import Layout
from tunelab.optimizers.tied import prepare_for_fused
from tunelab.train.checkpoint import copy_trainable
from tunelab.train.compiled import CompiledBody
from tunelab.train.data import label_tokens
from tunelab.train.loss import causal_lm_loss, sampled_label_loss
from tunelab.train.modes import evaluating
from tunelab.train.parallel.stepper import Stepper


def autocast(precision: str, device: torch.device):
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def forward_loss(model, batch: dict, n_items: int, device, precision: str) -> torch.Tensor:
    """Sum of token losses / tokens in the whole accumulated step, as transformers' Trainer does; the output
    head runs only at positions that carry a label (train/loss.py)."""
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    with autocast(precision, device):
        return causal_lm_loss(model, batch, n_items)


@torch.no_grad()
def eval_loss(model, batch: dict, precision: str) -> tuple[float, int]:
    """(summed token loss, label tokens) of one batch, the model in eval mode (put there for this batch unless a
    whole validation already did: train/modes.py evaluating)."""
    with evaluating(model):
        n = label_tokens(batch)
        device = next(model.parameters()).device
        return float(forward_loss(model, batch, n, device, precision)) * n, n


class LocalStepper(Stepper):
    checkpoint_subdir = "."  # model.pt and optimizer.pt sit in the checkpoint folder itself

    def __init__(self, model: nn.Module, optim_builder, cell, layout: Layout, precision: str = "fp32",
                 names: Callable[[str], str] | None = None):
        self.layout, self.cell, self._model, self.precision = layout, cell, model, precision
        self.max_grad_norm = cell.train.max_grad_norm
        # A together-group's member names its parameters as the cell alone does (train/members.py), in its
        # checkpoints and for the optimizer, so either can resume what the other saved.
        self.names: Callable[[str], str] = names or (lambda n: n)
        # Names let Muon tell embeddings from hidden matrices (the registry's `named`); other optimizers get bare
        # parameters, so their state is keyed as every engine keys it (checkpoints load across layouts).
        named = [(self.names(n), p) for n, p in model.named_parameters() if p.requires_grad]
        self.named = named  # what a checkpoint's model.pt holds (found once: a group's model has many modules)
        self.params = [p for _, p in named]
        self.optimizer = optim_builder(named if optim_spec(cell.optim.name).named else self.params)
        if hasattr(self.optimizer, "fused_step"):  # one gradient buffer for a tied embedding
            prepare_for_fused(model, self.optimizer)
        self.compiled = CompiledBody(model) if cell.train.compile else None

    def _compiling(self) -> contextlib.AbstractContextManager:
        return self.compiled() if self.compiled is not None else contextlib.nullcontext()

    def train_step(self, micro_batches, n_items, step: int = 0):
        model, device, opt = self._model, self.layout.device, self.optimizer
        if hasattr(opt, "fused_step"):
            # Optimizers that update inside backward (LOMO, AdaLomo) run forward/backward themselves:
            # no full set of gradients ever exists, so there is nothing to clip or step here.
            loss, norm = opt.fused_step(lambda b=micro_batches[0]: forward_loss(model, b, n_items, device,
                                                                                self.precision))
            return float(loss), None if norm is None else float(norm)
        loss = torch.zeros((), device=device)
        for b in micro_batches:
            with self._compiling():
                step_loss = forward_loss(model, b, n_items, device, self.precision)
            step_loss.backward()
            loss += step_loss.detach()
        return self.finish_step(loss, micro_batches, step)

    def finish_step(self, loss: torch.Tensor, micro_batches, step: int = 0) -> tuple[float, float]:
        """The step after its backward passes (the gradients in place, `loss` their summed loss): clipping, the
        optimizer, Sophia's refresh. A together-group in batched mode runs the backward passes of all its members
        in one (train/batched.py) and each member's rest here."""
        model, device, opt = self._model, self.layout.device, self.optimizer
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if hasattr(opt, "after_step"):  # e.g. Sophia refreshes its Hessian estimate
            opt.after_step(step=step, model=model, batch={k: v.to(device) for k, v in micro_batches[-1].items()},
                           sampled_loss=sampled_label_loss)  # the head in chunks
        loss_f, norm_f = torch.stack([loss.float(), norm.float().to(device)]).tolist()  # one device sync
        return loss_f, norm_f

    def eval_loss(self, batch):
        with self._compiling():
            return eval_loss(self._model, batch, self.precision)

    def evaluating(self) -> contextlib.AbstractContextManager:
        return evaluating(self._model)

    def save(self, path) -> None:
        path = Path(path)
        torch.save({n: p.detach().cpu() for n, p in self.named}, path / "model.pt")
        # Optimizers without a state_dict (some in-backward ones) have nothing more to save.
        if callable(getattr(self.optimizer, "state_dict", None)):
            torch.save(self.optimizer.state_dict(), path / "optimizer.pt")

    def load(self, path) -> None:
        path = Path(path)
        if (path / ".metadata").is_file():  # an engine's distributed checkpoint, saved under any layout
            return self._load_distributed(path)
        saved = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
        ours = {self.names(n): n for n, p in self._model.named_parameters() if p.requires_grad}
        copy_trainable(self._model, {ours.get(k, k): v for k, v in saved.items()}, path)
        if callable(getattr(self.optimizer, "load_state_dict", None)):  # saved whenever it has a state: required
            # (a missing one would restart the optimizer from zero under a run that says it resumed)
            self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))

    def _load_distributed(self, path: Path) -> None:
        """Reshard an engine's torch distributed checkpoint (its model and optimizer, `{"train": ...}` as the
        engines save it) onto this one process."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self._model, self.optimizer)
        optim_sd = dict(optim_sd)  # the groups' names are taken out below
        # This optimizer was given names (Muon tells matrices by them); an engine's was not, so its groups hold
        # no `param_names`: those stay this optimizer's own, everything else must be in the checkpoint.
        names = [g.pop("param_names", None) for g in optim_sd["param_groups"]]  # type: ignore[union-attr]
        state: dict[str, Any] = {"train": {"model": model_sd, "optim": optim_sd}}
        dcp.load(state, checkpoint_id=str(path))
        for group, n in zip(state["train"]["optim"]["param_groups"], names):
            if n is not None:
                group["param_names"] = n
        set_state_dict(self._model, self.optimizer, model_state_dict=state["train"]["model"],
                       optim_state_dict=state["train"]["optim"])

    def unwrap(self):
        return self._model
