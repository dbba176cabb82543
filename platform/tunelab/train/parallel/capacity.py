"""How many members `--together auto` puts in one together-group (run/together.py): as many as fit the device by
the memory model (memory.estimate_group, through predict.members_that_fit), in 85% of its memory: a CUDA device's
whole memory, or the memory this machine has available for a CPU run. Reads the model's config (files already on
this machine: a hub model not downloaded yet is not predicted), never its weights. Where the memory model does not
cover a member (a PEFT method or optimizer it does not model) or its config is not here, FALLBACK members."""

from __future__ import annotations

from tunelab.core.config import CellConfig

SHARE = 0.85  # of the device's memory a group may plan to fill
FALLBACK = 8  # members of a group whose peak the memory model cannot predict


def device_memory_mb(train_device: str) -> float:
    """train.device's memory on this machine: a CUDA device's total, or the host's available memory."""
    import psutil
    import torch

    from tunelab.machine.runtime import device_of

    device = device_of(train_device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1] / 2**20
    return psutil.virtual_memory().available / 2**20


def _model(cfg: CellConfig) -> tuple[object, str] | None:
    """(the model's config, its weights' dtype on this machine), or None when the config cannot be read here."""
    from transformers import AutoConfig

    from tunelab.machine.runtime import device_of, model_settings
    from tunelab.models.loading import resolve

    dtype, _ = model_settings(cfg.model, device_of(cfg.train.device))
    try:  # files already here only: sizing a group never waits for the hub (a hub model not yet downloaded: None)
        config = AutoConfig.from_pretrained(resolve(cfg.model.name), revision=cfg.model.revision,
                                            local_files_only=True)
    except (OSError, ValueError):  # the cell itself will say why it cannot load its model
        return None
    return config, str(dtype).removeprefix("torch.")


def members(cfgs: list[CellConfig], most: int, batched: bool = False) -> int:
    """How many of these cells (which share one base, in order) one group holds on this machine, 1..most
    (`batched`: in batched mode, every member's activations at once)."""
    from tunelab.train.parallel.predict import members_that_fit

    model = _model(cfgs[0])
    if model is None:
        return min(most, FALLBACK)
    budget = SHARE * device_memory_mb(cfgs[0].train.device)
    n = members_that_fit(model[0], cfgs[:most], model[1], budget, most, batched)
    return min(most, FALLBACK) if n is None else n


def peak_mb(cfgs: list[CellConfig]) -> float | None:
    """The memory model's peak of these cells as one group on this machine's device (tensors only), or None."""
    from tunelab.train.parallel.predict import group_peak_mb

    model = _model(cfgs[0])
    return None if model is None else group_peak_mb(model[0], cfgs, model[1])
