"""Dotted config keys (`optim.lr`): how a matrix file, `--set` and a search name a key of a cell's config."""

from __future__ import annotations

import copy
from typing import Any


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{'optim': {'lr': 1}} -> {'optim.lr': 1}; dotted keys pass through."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and "." not in key:  # sections are one level deep
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def set_dotted(d: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for p in parents:
        nxt = d.setdefault(p, {})
        if not isinstance(nxt, dict):
            nxt = d[p] = {}
        d = nxt
    d[last] = copy.deepcopy(value)


def get_dotted(obj: Any, dotted: str) -> Any:
    """The value at a dotted key of nested mappings, None where a part is missing."""
    for part in dotted.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj
