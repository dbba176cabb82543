"""Model sources: a catalog alias (tunelab.core.registries.MODELS), a local folder, or a hub id; each gives
(model, tokenizer).

`load` reads the whole model onto one device. A model larger than one device is built with `empty` instead
(every parameter on the meta device: no memory) and filled after the engine has sharded it, each process
reading only its own slices of the checkpoint through `Weights` (train/parallel/deferred.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tunelab.core import hub_access
from tunelab.core.config import ModelCfg
from tunelab.core.files import read_json
from tunelab.core.paths import cache_dir  # noqa: F401 - where models (and data) are cached; callers reach it here
from tunelab.core.registries import MODELS
from tunelab.machine.runtime import Runtime, model_settings


def resolve(name: str) -> str:
    """The from_pretrained argument for a model name: a folder for aliases (tunelab.core.registries.MODELS) and
    local paths, else the hub id."""
    if name in MODELS:
        return str(MODELS[name].folder.load()())
    local = Path(name).expanduser()
    return str(local) if local.is_dir() else name


def tokenizer(cfg: ModelCfg) -> Any:
    from transformers import AutoTokenizer

    src = resolve(cfg.name)
    hub = hub_access.prepare_hub() if src == cfg.name else None  # a hub id: bounded, and offline if unreachable
    try:
        tok = AutoTokenizer.from_pretrained(src, revision=cfg.revision)
    except OSError as e:  # transformers' message does not always say which model it was
        raise OSError(f"could not load the tokenizer of {cfg.name!r}: {e}" + (f" ({hub})" if hub else "")) from e
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load(cfg: ModelCfg, where: Runtime | torch.device | str = "cpu", **from_pretrained: Any) -> tuple[Any, Any]:
    """models.load(cfg.model, runtime) -> (model, tokenizer): `model` and `tokenizer` together."""
    return model(cfg, where, **from_pretrained), tokenizer(cfg)


def model(cfg: ModelCfg, where: Runtime | torch.device | str = "cpu", **from_pretrained: Any) -> Any:
    """The model, on the runtime's device in its dtype and attention kernel; given a bare device, those are
    resolved for it (runtime.model_settings). Extra keyword arguments go to from_pretrained (a PEFT method's
    quantization_config, for instance)."""
    from transformers import AutoModelForCausalLM

    if isinstance(where, Runtime):
        device, dtype, attn = where.device, where.dtype, where.attn
    else:
        device = torch.device(where)
        dtype, attn = model_settings(cfg, device)
    if "quantization_config" in from_pretrained:  # quantized weights are placed at load, never moved
        from_pretrained.setdefault("device_map", {"": device})
    src = resolve(cfg.name)
    hub = hub_access.prepare_hub() if src == cfg.name else None  # a hub id: bounded, and offline if unreachable
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            src, revision=cfg.revision, dtype=dtype, attn_implementation=attn, **from_pretrained
        )
    except OSError as e:  # transformers' message does not always say which model it was
        raise OSError(f"could not load model {cfg.name!r}: {e}" + (f" ({hub})" if hub else "")) from e
    return loaded if "device_map" in from_pretrained else loaded.to(device)


def folder(cfg: ModelCfg) -> Path:
    """The local folder of the model's files: an alias's cache or a local folder as is; a hub id is fetched
    into (or found in) the Hugging Face cache."""
    src = resolve(cfg.name)
    if Path(src).is_dir():
        return Path(src)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(src, revision=cfg.revision, allow_patterns=["*.json", "*.safetensors"]))


def empty(cfg: ModelCfg, dtype: torch.dtype, attn: str) -> Any:
    """The model of `cfg` with every parameter on the meta device (it takes no memory) and its buffers (rotary
    frequencies, which no checkpoint holds) computed for real, on the CPU. Tied weights are tied."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder(cfg))
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    model.tie_weights()  # init_empty_weights re-creates each parameter it registers, which unties them
    return model.eval()  # as from_pretrained returns it


class Weights:
    """A model folder's safetensors files, read a slice at a time: a process that holds a shard of a weight
    reads that shard's bytes and no others (the files are memory-mapped and closed after each read)."""

    def __init__(self, root: Path):
        from safetensors import safe_open

        self.root = Path(root)
        self.files: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in sorted(self.root.glob("*.safetensors")):
            with safe_open(f, framework="pt") as st:
                for key in st.keys():
                    self.files[key] = f
                    self.shapes[key] = tuple(st.get_slice(key).get_shape())

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor `key`, or only its block `index` (one slice per dimension)."""
        from safetensors import safe_open

        with safe_open(self.files[key], framework="pt") as st:
            if index is None:
                return st.get_tensor(key)
            return st.get_slice(key)[index]

    def read_flat(self, key: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor `key` (DeepSpeed's ZeRO-3 partitions are such
        ranges): the rows that hold them are read, then cut."""
        shape = self.shapes[key]
        row = 1
        for d in shape[1:]:
            row *= d
        if not shape or end <= start:
            return self.read(key).reshape(-1)[start:end]
        first, last = start // row, -(-end // row)
        block = self.read(key, (slice(first, last),)).reshape(-1)
        return block[start - first * row:end - first * row]


def source_note(name: str) -> str | None:
    """What a model's weights are when that matters for its scores (a dequantized stand-in), else None."""
    try:
        folder = Path(resolve(name))
    except Exception:  # noqa: BLE001 - a model that cannot be had here has no note
        return None
    from tunelab.models.catalog import SOURCE_NOTE  # the note a catalog builder leaves in the folder it made

    note = read_json(folder / SOURCE_NOTE, dict) if folder.is_dir() else None
    return (note or {}).get("note")
