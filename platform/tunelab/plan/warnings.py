"""Plan-time warnings: what a matrix may do but most likely does not mean. `exp plan` and `exp run` show them (on
stderr, before anything runs) and go on (exit 0); `exp plan --json` lists them with each cell.

Each check reads the registries' facts (core/registries.py), like the errors of plan/__init__.py; a matrix-level
one (a `tune:` section's) is tune/plan.py's `warnings`.
"""

from __future__ import annotations

from collections.abc import Callable

from tunelab.core.config import CellConfig
from tunelab.core.registries import PEFT, optimizer_spec


def _relative_step_on_zeros(cfg: CellConfig) -> list[str]:
    """AdaLomo and Adafactor scale an update by the weight's RMS: LoRA's B matrices start at zero and stay near it
    (AdaLomo moves them by lr x its eps floor, 1e-3: a thousandth of the step it takes elsewhere)."""
    try:
        relative = optimizer_spec(cfg.optim.name).relative_step
    except (ValueError, ImportError):  # an optimizer the plan refuses says so as an error
        return []
    zeros = PEFT[cfg.peft.method].zero_init
    if not (relative and zeros):
        return []
    return [f"optim.name {cfg.optim.name} scales each update by the weight's own size (a relative step), and "
            f"peft.method {cfg.peft.method} starts {zeros} at zero: they hardly move, so the adapter hardly learns. "
            f"Use an optimizer with an absolute step (adamw) with {cfg.peft.method}, or {cfg.optim.name} with "
            "peft.method none"]


CHECKS: list[Callable[[CellConfig], list[str]]] = [_relative_step_on_zeros]


def cell_warnings(cfg: CellConfig) -> list[str]:
    """Every warning of one checked cell, in words."""
    return [w for check in CHECKS for w in check(cfg)]
