"""What the one-process CPU step's own attention implementations share (segments.py, cpu_attention.py).

Each is registered with transformers' attention interface under a name, put on the model's config only while
a step trains (`swapped`), and used only for a model on which a check, run once, says it gives the model's
own logits (`verdict`): its attention is SDPA on CPU and goes through transformers' interface.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

_VERDICTS: dict[str, weakref.WeakKeyDictionary] = {}  # check's name -> {model: verdict}


@contextlib.contextmanager
def swapped(model: Any, name: str) -> Iterator[None]:
    """The model's attention implementation is `name` inside; restored on exit."""
    config = model.config
    saved = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = saved


def verdict(model: Any, name: str, check: Callable[[Any, Any], bool]) -> bool:
    """check(model, config) once per model and name, in eval mode without gradients; False for a model whose
    attention is not SDPA on CPU, or where the check raises."""
    seen = _VERDICTS.setdefault(name, weakref.WeakKeyDictionary())
    if model not in seen:
        seen[model] = _sdpa_on_cpu(model) and _quietly(model, check)
    return seen[model]


def _sdpa_on_cpu(model: Any) -> bool:
    config = getattr(model, "config", None)
    param = next(model.parameters(), None)
    return config is not None and getattr(config, "_attn_implementation", None) == "sdpa" and param is not None \
        and param.device.type == "cpu"


def _quietly(model: Any, check: Callable[[Any, Any], bool]) -> bool:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return bool(check(model, model.config))
    except Exception:  # noqa: BLE001 - any failure means: not a model whose attention can be served so
        return False
    finally:
        model.train(was_training)


def probe_ids(config: Any, shape: tuple[int, int]) -> torch.Tensor:
    """Token ids for a check's short input, the same on every call."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(3, min(int(config.vocab_size), 1000), shape, generator=gen)
