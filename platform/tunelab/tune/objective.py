"""What a search reads off a trial's cell folder: its value at a rung (INTERMEDIATES in registries.py, so another
source, such as a benchmark scored on the rung checkpoint, is one function and one registry entry) and its
objective at the full budget (the metric's score in the trial's own evaluation)."""

from __future__ import annotations

import math
from pathlib import Path

from tunelab.cellfolder import CellFolder


def val_loss_at(run_dir: Path, step: int) -> float | None:
    """The validation loss the loop measured at `step` (a run that stops at a step validates there)."""
    for record in CellFolder(run_dir).metrics():
        if record.get("step") == step and "val_loss" in record:
            return float(record["val_loss"])
    return None


def final_value(run_dir: Path, eval_id: str, metric: str) -> float | None:
    """The metric's score in the evaluation `eval_id` of the cell (None: not scored, or unavailable)."""
    res = (CellFolder(run_dir).results(eval_id).get("tasks") or {}).get(metric) or {}
    value = res.get("value")
    if res.get("status", "ok") != "ok" or not isinstance(value, (int, float)):
        return None
    return float(value)


def is_number(value: float | None) -> bool:
    return value is not None and not math.isnan(value)
