"""Sharded initialisation: a model larger than one device is never whole on any process.

    model = models.empty(cfg.model, dtype, attn)          # every parameter on the meta device
    model, weights = with_adapters(model, apply_peft, models.Weights(folder))
    stepper = parallel.prepare(model, ..., weights=weights)  # shards (FSDP2, TP, stages), then materialize()

`materialize` gives each process memory for its own shards only and fills them: a DTensor's block (FSDP2's
dim-0 shard, a tensor-parallel column or row block, both at once) is read from the checkpoint files by its
global offset; the parameters a pipeline stage does not hold are never read. So a process's peak during load
is its shards plus the one block being read, where loading whole and then sharding would hold the whole model.

PEFT adapters are not in the checkpoint, and their initial values must be the ones one process would draw
(same seed, same order of draws). `with_adapters` therefore runs the PEFT method on the model with every
base parameter swapped for an empty (0-element) CPU tensor: peft creates and initialises the adapters for
real on the CPU (it reads the layers' in/out features, not their weights), and places them on the base
weights' device, which is then the CPU. Their values are kept, and the model goes back to the meta device.
DoRA reads the base weights to initialise its magnitudes, so it is loaded whole (`needs_whole`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tunelab.core.errors import UserError


@dataclass
class Deferred:
    """Where each parameter's initial value comes from: a key of the checkpoint files, or a full tensor
    (adapters), by the parameter's name in the model handed to the engine (names survive sharding)."""

    weights: Any  # models.Weights: read(key, index)
    keys: dict[str, str] = field(default_factory=dict)  # parameter name -> checkpoint key
    values: dict[str, torch.Tensor] = field(default_factory=dict)  # parameter name -> full initial value

    def read(self, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        if name in self.values:
            full = self.values[name]
            return full if index is None else full[index]
        return self.weights.read(self.keys[name], index)


def _swap(model: nn.Module, make: Callable[[nn.Parameter], nn.Parameter | None]) -> None:
    """Replace parameters in place by identity (a tied weight stays one parameter); make -> None keeps one."""
    new: dict[int, nn.Parameter | None] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in new:
                new[id(p)] = make(p)
            if new[id(p)] is not None:
                module._parameters[name] = new[id(p)]


def with_adapters(model: nn.Module, apply: Callable[[nn.Module], nn.Module], weights) -> tuple[nn.Module, Deferred]:
    """apply(model) (the cell's PEFT method, or nothing) on a meta-device model -> (the wrapped model, still
    on the meta device, and where each of its parameters' values will come from)."""
    base: dict[int, tuple[tuple[int, ...], list[str]]] = {}  # hollow parameter -> (shape, original names)
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)

    def hollow(p):
        h = nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=p.requires_grad)
        base[id(h)] = (tuple(p.shape), names[id(p)])
        return h

    _swap(model, hollow)
    model = apply(model)
    d = Deferred(weights)
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in base:
            found = [k for k in base[id(p)][1] if k in weights]
            if not found:
                raise UserError(f"the checkpoint in {weights.root} has no weight {base[id(p)][1][0]!r}", key="model")
            d.keys[n] = found[0]
        elif p.device.type != "meta":  # an adapter, initialised for real
            d.values[n] = p.detach().clone()

    def to_meta(p):
        shape = base[id(p)][0] if id(p) in base else tuple(p.shape)
        return nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)

    _swap(model, to_meta)
    return model, d


def needs_whole(peft_method: str) -> str | None:
    """Why a PEFT method cannot start from a meta-device model (None: it can)."""
    if peft_method == "dora":
        return "DoRA initialises its magnitudes from the base weights"
    if peft_method == "qlora":
        return "QLoRA quantizes the weights as they load"
    return None


def _block(p: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...] | None]:
    """(this process's tensor, its block of the global tensor; None: the whole)."""
    if not isinstance(p, DTensor):
        return p, None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    local = p.to_local()
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"a shard of shape {tuple(local.shape)} where its placement says {tuple(shape)}")
    return local, tuple(slice(o, o + s) for o, s in zip(offset, shape))


@torch.no_grad()
def materialize(modules: list[nn.Module], deferred: Deferred, device: torch.device | str) -> None:
    """Give the (sharded) meta-device `modules` memory on `device` and fill every parameter's local block.
    Buffers were real all along (models.empty); to_empty would leave them undefined, so they are put back."""
    for m in modules:
        buffers = {n: b.detach().clone() for n, b in m.named_buffers()}
        m.to_empty(device=device)
        for n, b in m.named_buffers():
            (b.to_local() if isinstance(b, DTensor) else b).copy_(buffers[n])
        for name, p in m.named_parameters():
            local, index = _block(p)
            if local.numel():
                local.copy_(deferred.read(name, index))
