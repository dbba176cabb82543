"""How many members `--together auto` puts in one together-group (run/together.py): as many as fit the device by
the memory model (memory.estimate_group, through predict.members_that_fit), in 85% of its memory: a CUDA device's
whole memory, or the memory this machine has available for a CPU run. Reads the model's config (files already on
this machine: a hub model not downloaded yet is not predicted; a local Llama-like folder's config.json read as it
stands, `_plain_config`), never its weights. Where the memory model does not cover a member (a PEFT method or
optimizer it does not model) or its config is not here, FALLBACK members."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

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
    from tunelab.machine.runtime import device_of, model_settings
    from tunelab.models.loading import resolve

    dtype, _ = model_settings(cfg.model, device_of(cfg.train.device))
    src = resolve(cfg.model.name)
    config = _plain_config(src)
    if config is None:
        from transformers import AutoConfig

        try:  # files already here only: sizing a group never waits for the hub (a hub model not yet downloaded)
            config = AutoConfig.from_pretrained(src, revision=cfg.model.revision, local_files_only=True)
        except (OSError, ValueError):  # the cell itself will say why it cannot load its model
            return None
    return config, str(dtype).removeprefix("torch.")


# Every field of a config that the memory model reads (memory.shape_of).
SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")


def _plain_config(src: str) -> SimpleNamespace | None:
    """A local model folder's config.json as it stands, when it sets every field the memory model reads and its
    model type is Llama-like (memory.LEAN_TYPES, whose config classes add nothing to those fields when all are
    given): the runner then sizes a group without importing transformers, 1-2 s of every `exp run --together auto`
    before its first group can start. None for anything else (AutoConfig then: its defaults, aliases and nested
    configs)."""
    from tunelab.train.parallel.memory import LEAN_TYPES

    path = Path(src) / "config.json"
    try:
        raw = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("model_type") not in LEAN_TYPES \
            or any(raw.get(k) is None for k in SHAPE_FIELDS):
        return None
    return SimpleNamespace(**raw)


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


def peak_mb(cfgs: list[CellConfig], batched: bool = False) -> float | None:
    """The memory model's peak of these cells as one group on this machine's device (tensors only), or None
    (`batched`: in batched mode)."""
    from tunelab.train.parallel.predict import group_peak_mb

    model = _model(cfgs[0])
    return None if model is None else group_peak_mb(model[0], cfgs, model[1], batched=batched)
