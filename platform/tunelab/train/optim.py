"""Optimizer registry: names users write in YAML -> a constructor taking (params, OptimCfg)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable

import torch

Builder = Callable[[Iterable, object], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Builder] = {}


def register(name: str):
    def deco(fn: Builder) -> Builder:
        OPTIMIZERS[name] = fn
        return fn

    return deco


def _torch(cls_name: str) -> Builder:
    def build(params, cfg):
        return getattr(torch.optim, cls_name)(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **cfg.kwargs)

    return build


for _name, _cls in {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "adafactor": "Adafactor"}.items():
    register(_name)(_torch(_cls))


def _import_class(spec: str) -> type:
    """'torch.optim.RMSprop' or 'package.module:Class'."""
    module, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def check_name(name: str) -> None:
    """Raise ValueError unless `name` names an optimizer; called at config validation time."""
    if name in OPTIMIZERS:
        return
    if name.startswith("torch.optim.") or ":" in name:
        try:
            cls = _import_class(name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"cannot import optimizer {name!r}: {e}") from None
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            return
        raise ValueError(f"{name!r} is not a torch.optim.Optimizer subclass")
    raise ValueError(
        f"unknown optimizer {name!r}; known: {', '.join(sorted(OPTIMIZERS))}, "
        "or any 'torch.optim.Name' or 'package.module:Class'"
    )


def build(params: Iterable, cfg) -> torch.optim.Optimizer:
    if cfg.name in OPTIMIZERS:
        return OPTIMIZERS[cfg.name](params, cfg)
    return _import_class(cfg.name)(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **cfg.kwargs)
