"""Switching a model between training and eval mode less often, and each switch for less.

A switch costs a walk over every module: nn.Module.train recurses through them in Python, and a transformers model
that uses hub kernels (the default where the `kernels` package is installed, as here) kernelizes itself again on every
switch, another walk. A together-group's model holds every member's adapter modules (16 LoRA members of SmolLM2-135M:
12,000 modules, 75-85 ms a switch, measured), and validation used to switch twice a batch and each member's turn once
more: seconds of a search. So a whole validation switches once each way (`evaluating`; the loop's validation and
model_validation_loss), a member's turn only when the model is not in training mode (members.py), and `set_training`
does nn.Module.train's part in one loop that writes the flag into each module's __dict__ (20-25% less), and on a CPU
skips the kernels' walk, which gives no layer another forward there (`_kernels_mode`). A module whose class has its
own train() (peft's DoRA layer clears a cache there) or its own attribute handling gets its own train() called, which
does its subtree as nn.Module.train would. transformers' PreTrainedModel.train is nn.Module.train and then its kernels
mode set: such a model is walked like any other and its kernels mode set after its subtree, as there. The flags and
kernels modes are those nn.Module.train gives (tests/test_members.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

_PLAIN_TRAIN, _PLAIN_SETATTR = nn.Module.train, nn.Module.__setattr__
_KNOWN: dict[type, bool] = {}  # class -> whether only its train() can differ from a plain module's


def _plain_but_train(cls: type) -> bool:
    known = _KNOWN.get(cls)
    if known is None:
        known = _KNOWN[cls] = cls.__setattr__ is _PLAIN_SETATTR \
            and all("training" not in vars(base) for base in cls.__mro__)
    return known


def _plain(cls: type) -> bool:
    """Whether nn.Module.train would do no more on an instance of `cls` than set `training` and recurse."""
    return getattr(cls, "train", None) is _PLAIN_TRAIN and _plain_but_train(cls)


def _pretrained(m: nn.Module) -> bool:
    """Whether m's train() is transformers' PreTrainedModel.train (and nothing else differs from a plain module)."""
    from transformers import PreTrainedModel

    return type(m).train is PreTrainedModel.train and _plain_but_train(type(m))


def _kernels_mode(m: Any, mode: bool) -> None:
    """What PreTrainedModel.train does after nn.Module.train: the kernels mode of a model that uses hub kernels.
    On a device no kernel is registered for (a CPU: transformers maps kernels for cuda, rocm and xpu only) its
    kernelize walk would give every kernel layer back the forward its class has, which the model was given when it
    was loaded: only the mode is recorded then, as set_use_kernels records it (the walk is most of a switch's cost
    in a together-group: 16 SmolLM2 members, 55 of 75 ms)."""
    from transformers.utils import is_kernels_available

    if is_kernels_available() and m.use_kernels:
        from kernels import Mode

        value = Mode.INFERENCE if not mode else Mode.TRAINING
        if value != getattr(m, "_kernels_mode", None) and _unmapped(m):
            m._kernels_mode = value
            return
        m.kernels_mode = value


def _unmapped(m: Any) -> bool:
    """Whether no kernel is registered for m's device: kernels' mapping (transformers' registered in it, as
    set_use_kernels does) has no entry for a CPU and m has no kernel_config of its own. False when unsure."""
    try:
        from kernels._internals.layer.layer import _KERNEL_MAPPING
        from transformers.integrations.hub_kernels import register_kernel_mapping_transformers

        device = getattr(m, "_kernels_device", None) or m.device
        if torch.device(device).type != "cpu" or getattr(m, "kernel_config", None) is not None:
            return False
        register_kernel_mapping_transformers()
        return not any("cpu" in devices for devices in _KERNEL_MAPPING.get().values())
    except Exception:  # noqa: BLE001 - another kernels version: transformers' own path
        return False


def set_training(model: nn.Module, mode: bool = True) -> nn.Module:
    """model.train(mode), the same flags on the same modules, without the per-module Python recursion."""
    stack, seen, pretrained = [model], set(), []
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if not _plain(type(m)):
            if not _pretrained(m):
                m.train(mode)
                continue
            pretrained.append(m)
        m.__dict__["training"] = mode
        stack.extend(c for c in m._modules.values() if c is not None)
    for m in reversed(pretrained):  # the innermost first, each after its subtree, as the recursion does
        _kernels_mode(m, mode)
    return model


_INSIDE = "_tunelab_evaluating"  # set on the model while an `evaluating` block runs


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """Every module in eval mode for the block, and after it every module in the mode the model's top module was in
    (what `model.eval()` ... `model.train(was_training)` around each batch did): a whole validation switches once
    each way, not once a batch (a switch re-kernelizes a transformers model that uses hub kernels, a walk of its
    own). A nested `evaluating` (eval_loss inside a validation) switches nothing."""
    if model.__dict__.get(_INSIDE):
        yield model
        return
    was_training = model.training
    set_training(model, False)
    model.__dict__[_INSIDE] = True
    try:
        yield model
    finally:
        del model.__dict__[_INSIDE]
        set_training(model, was_training)
