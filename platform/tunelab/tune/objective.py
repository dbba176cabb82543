"""What a search reads off a trial's cell folder: its value at a rung (INTERMEDIATES in core/registries.py: the loop's
validation loss, or the objective's task scored on the rung checkpoint; another source is one function and one
registry entry) and its objective at the full budget (the metric's score in the trial's own evaluation)."""

from __future__ import annotations

import math
from pathlib import Path

from tunelab.folders.cell import CellFolder


def val_loss_at(run_dir: Path, step: int, metric: str, eval_id: str | None) -> float | None:
    """The validation loss the loop measured at `step` (a run that stops at a step validates there)."""
    for record in CellFolder(run_dir).metrics():
        if record.get("step") == step and "val_loss" in record:
            return float(record["val_loss"])
    return None


def checkpoint_score_at(run_dir: Path, step: int, metric: str, eval_id: str | None) -> float | None:
    """`metric` scored on the checkpoint of `step` by the trial's checkpoint evaluation `eval_id` (named by the
    trial cell, not read from the folder's config.yaml: the winner's retraining rewrites that with the matrix's
    evaluation). None until it is scored, or when it is unavailable there."""
    from tunelab.checkpoint_scores.steps import score_at

    return score_at(run_dir, step, metric, eval_id) if eval_id else None


def final_value(run_dir: Path, eval_id: str, metric: str) -> float | None:
    """The metric's score in the evaluation `eval_id` of the cell (None: not scored, or unavailable)."""
    res = (CellFolder(run_dir).results(eval_id).get("tasks") or {}).get(metric) or {}
    value = res.get("value")
    if res.get("status", "ok") != "ok" or not isinstance(value, (int, float)):
        return None
    return float(value)


def is_number(value: float | None) -> bool:
    return value is not None and not math.isnan(value)
