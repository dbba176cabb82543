"""Optimizer registry: names users write in YAML -> how to build the optimizer, checked at plan time.

`optim.name` is a registered name, any `torch.optim.Name`, or any `package.module:Class`; the class is
called as Class(params, lr=optim.lr, weight_decay=optim.weight_decay, **optim.kwargs). docs/optimizers.md
says where each registered optimizer comes from.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from tunelab.train import optimizers as own


@dataclass(frozen=True)
class Spec:
    factory: Callable[..., torch.optim.Optimizer]
    source: str  # shown by docs and error messages: where the implementation comes from
    named: bool = False  # takes (name, parameter) pairs, to tell embeddings from hidden matrices
    fused: bool = False  # updates inside backward: no gradient accumulation, grad clipping done inside


OPTIMIZERS: dict[str, Spec] = {
    "adamw": Spec(torch.optim.AdamW, "torch.optim.AdamW"),
    "adam": Spec(torch.optim.Adam, "torch.optim.Adam"),
    "sgd": Spec(torch.optim.SGD, "torch.optim.SGD"),
    "adafactor": Spec(torch.optim.Adafactor, "torch.optim.Adafactor"),
    "lion": Spec(own.Lion, "tunelab optimizers/lion.py"),
    "adan": Spec(own.Adan, "tunelab optimizers/adan.py"),
    "sophiag": Spec(own.SophiaG, "tunelab optimizers/sophia.py"),
    "lomo": Spec(own.Lomo, "tunelab optimizers/lomo.py", fused=True),
    "adalomo": Spec(own.AdaLomo, "tunelab optimizers/adalomo.py", fused=True),
}
if hasattr(torch.optim, "Muon"):  # torch >= 2.9
    OPTIMIZERS["muon"] = Spec(own.MuonAdamW, "torch.optim.Muon + torch.optim.AdamW (optimizers/muon.py)",
                              named=True)

# Set through their own keys in the optim section, never through optim.kwargs.
RESERVED = {"params": "the trainable parameters", "lr": "optim.lr", "weight_decay": "optim.weight_decay"}


def _import_class(spec: str) -> type:
    """'torch.optim.RMSprop' or 'package.module:Class'."""
    module, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def check_name(name: str) -> None:
    """Raise ValueError unless `name` names an optimizer; called at config validation time."""
    spec(name)


def spec(name: str) -> Spec:
    if name in OPTIMIZERS:
        return OPTIMIZERS[name]
    if name.startswith("torch.optim.") or ":" in name:
        try:
            cls = _import_class(name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"cannot import optimizer {name!r}: {e}") from None
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            return Spec(cls, name)
        raise ValueError(f"{name!r} is not a torch.optim.Optimizer subclass")
    raise ValueError(
        f"unknown optimizer {name!r}; known: {', '.join(sorted(OPTIMIZERS))}, "
        "or any 'torch.optim.Name' or 'package.module:Class'"
    )


@functools.cache  # signatures are read once per class: plan time validates every cell
def _accepts(factory: Callable) -> tuple[set[str], bool]:
    """(keyword names the constructor takes, whether it takes **kwargs too)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no introspectable signature (a C extension): accept anything
        return set(), True
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def check_args(name: str, weight_decay: float, kwargs: dict) -> None:
    """Raise ValueError if the optimizer's constructor cannot take these arguments (plan time)."""
    s = spec(name)
    accepted, open_ended = _accepts(s.factory)
    if "model" in accepted and "params" not in accepted:
        # lomo_optim:Lomo and friends hook a whole model themselves; tunelab hands over parameters.
        raise ValueError(f"optimizer {name!r} is built from a model, not from parameters, so tunelab cannot "
                         "construct it; for LOMO and AdaLomo use optim.name: lomo or adalomo")
    for key in kwargs:
        if key in RESERVED:
            raise ValueError(f"optim.kwargs.{key}: set {RESERVED[key]} instead")
    unknown = [k for k in kwargs if k not in accepted] if not open_ended else []
    if unknown:
        allowed = sorted(accepted - set(RESERVED))
        raise ValueError(f"optimizer {name!r} ({s.source}) takes no argument(s) {unknown} in optim.kwargs; "
                         f"it takes: {', '.join(allowed) or 'nothing'}")
    if weight_decay and "weight_decay" not in accepted and not open_ended:
        raise ValueError(f"optimizer {name!r} ({s.source}) has no weight_decay; leave optim.weight_decay at 0")


def check_compatible(cell) -> None:
    """Raise ValueError when the optimizer cannot train this cell as configured (plan time).

    LOMO and AdaLomo apply each parameter's update during backward and free its gradient at once, so
    gradients of several micro-batches can never be summed; and they do fp32 math on fp32 or bf16 weights
    without the dynamic loss scaling fp16 weights would need.
    """
    name = cell.optim.name
    if not spec(name).fused:
        return
    if cell.train.grad_accum > 1:
        raise ValueError(
            f"optim.name {name!r} updates each parameter inside backward and frees its gradient at once, so "
            f"gradients of {cell.train.grad_accum} micro-batches cannot be accumulated; set train.grad_accum "
            "to 1 and raise train.batch_size instead")
    if cell.model.dtype == "float16":
        raise ValueError(
            f"optim.name {name!r} with model.dtype float16 would need dynamic loss scaling, which tunelab does "
            "not implement; use bfloat16 or float32")


def build(params: Iterable, cfg, *, max_grad_norm: float | None = None) -> torch.optim.Optimizer:
    """The optimizer for `params` (tensors, or (name, tensor) pairs) as `cfg` (an OptimCfg) says.

    max_grad_norm (train.max_grad_norm) becomes LOMO/AdaLomo's clip_grad_norm unless optim.kwargs sets it:
    those clip inside their own backward passes, the loop cannot do it for them.
    """
    s = spec(cfg.name)
    items = list(params)
    if not s.named:
        items = [it[1] if isinstance(it, tuple) else it for it in items]
    # YAML has lists where constructors expect tuples (betas, eps pairs).
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.kwargs.items()}
    if s.fused and max_grad_norm is not None:
        kwargs.setdefault("clip_grad_norm", max_grad_norm)
    accepted, open_ended = _accepts(s.factory)
    if cfg.weight_decay or open_ended or "weight_decay" in accepted:
        kwargs["weight_decay"] = cfg.weight_decay
    return s.factory(items, lr=cfg.lr, **kwargs)
