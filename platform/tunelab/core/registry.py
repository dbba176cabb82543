"""`Registry[T]`: the one shape of every name a user writes in YAML (models, templates, optimizers, ...), and
`Lazy`, the one way tunelab defers an import.

An entry is a typed object registered with `reg.add(name, entry)` (core/registries.py): the facts the checks need
(an optimizer's state count, whether a PEFT method needs CUDA) as fields, and the implementation as a
`Lazy("package.module:attr")` that its user loads (`.load()`) when it needs it. So a low layer (`plan`, the
plan-time checks) knows every name without importing the stages that implement them, and the layering test
(tests/test_layering.py) sees every deferred import, because each is a `Lazy("...")` literal.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownName(ValueError):
    """A name that is not registered: the message lists the known ones."""


def import_target(target: str) -> Any:
    """'package.module:attr' (or 'package.module.attr') -> the object."""
    module, _, attr = target.partition(":") if ":" in target else target.rpartition(".")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class Lazy:
    """An implementation named by 'module:attr', imported when first asked for (then cached by Python)."""

    target: str

    def load(self) -> Any:
        return import_target(self.target)


class Registry(Generic[T]):
    def __init__(self, kind: str, hint: str = ""):
        self.kind = kind  # "optimizer": used in "unknown optimizer 'x'; known: ..."
        self.hint = hint  # what else is accepted besides the names, for the error message
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = entry

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownName(self.unknown(name)) from None

    def unknown(self, name: str) -> str:
        """The message for a name that is not registered: the closest names first ("did you mean"), then all."""
        from tunelab.core.errors import did_you_mean

        return f"unknown {self.kind} {name!r}{did_you_mean(name, list(self._entries))}; known: " \
               f"{', '.join(self._entries)}{self.hint}"

    def check(self, name: str) -> None:
        if name not in self._entries:
            raise UnknownName(self.unknown(name))

    # A read-only mapping of names, so `name in reg`, `reg[name]` and iterating names read naturally.
    __getitem__ = get

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        return list(self._entries)

    def items(self) -> list[tuple[str, T]]:
        return [(name, self.get(name)) for name in self._entries]
