"""The objective of a search and what a search reads off a trial's cell folder: its value at a rung (INTERMEDIATES
in core/registries.py: the loop's validation loss, or the objective's task scored on the rung checkpoint; another
source is one function and one registry entry) and its objective at the full budget (the metric's score in the
trial's own evaluation).

The objective may be any task the eval section produces: tunelab's (TASKS says its split and direction), or an
lm-eval task or one of `eval.include_path`, whose YAML says which split it scores (lm-eval scores `test_split` when
there is one, else `validation_split`) and in which direction its first metric is better.
"""

from __future__ import annotations

import math
from pathlib import Path

from tunelab.core.config import CellConfig
from tunelab.core.errors import UserError
from tunelab.core.registries import TASKS
from tunelab.folders.cell import CellFolder
from tunelab.matrix.tune_section import TuneSpec, test_selection_refused


def resolved(spec: TuneSpec, config: CellConfig, path: Path, at: str) -> tuple[TuneSpec, bool]:
    """(the section with its mode filled in for a task tunelab does not register, whether the objective is scored
    on a test set); UserError when no task of the eval section produces the metric, or it is a test set's score
    without allow_test_selection."""
    if spec.metric in TASKS:
        return spec, TASKS[spec.metric].split == "test"
    from tunelab.plan import lmtasks

    if spec.metric not in config.eval.tasks:
        raise UserError(f"no task produces {spec.metric!r}: the objective is one of tunelab's tasks "
                        f"({', '.join(TASKS)}) or a task of the eval section (eval.tasks: "
                        f"{', '.join(config.eval.tasks) or 'none'})", file=path, key=f"{at}.metric")
    split = lmtasks.split_of(spec.metric, config.eval.include_path)
    if split != "validation" and not spec.allow_test_selection:
        why = "" if split == "test" else " (its YAML names no validation_split, so it counts as one)"
        raise UserError(test_selection_refused(spec.metric) + why, file=path, key=f"{at}.metric")
    if spec.mode is None:
        higher = lmtasks.higher_is_better(spec.metric, config.eval.include_path)
        spec = spec.model_copy(update={"mode": "max" if higher else "min"})
    return spec, split != "validation"


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
