"""Scores along training, as a cell's folder and config say them: which checkpoints the evaluation asks for
(eval.checkpoints), which are scored, which must stay on disk, and which is best (train.select).

One answer for everyone: the training loop (it saves the asked steps and keeps what waits for its evaluation),
the evaluator beside training, the cell (selection, pruning), the report, and a search that wants a checkpoint's
score as its intermediate value (`score_at`). It reads files only (results.json of eval/<eval-id>/step-N/).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tunelab.core.config import CellConfig
from tunelab.core.registries import TASKS
from tunelab.folders.cell import CellFolder


def value_of(results: dict, metric: str) -> float | None:
    """A task's headline value in a results.json; None when it was not scored or is unavailable."""
    res = (results.get("tasks") or {}).get(metric) or {}
    value = res.get("value")
    if res.get("status", "ok") != "ok" or not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    return float(value) if value == value else None  # NaN is no score


def score_at(folder: CellFolder | Path, step: int, metric: str, eval_id: str | None = None) -> float | None:
    """The score of task `metric` on the checkpoint of `step`, from the cell's checkpoint evaluation (or the one
    named by `eval_id`); None when that checkpoint is not scored (yet), or the task is unavailable there. For a
    search (tune) that prunes trials on a checkpoint score."""
    folder = folder if isinstance(folder, CellFolder) else CellFolder(Path(folder))
    if eval_id is None:
        try:
            eval_id = folder.config().checkpoint_eval_id()
        except Exception:  # noqa: BLE001 - a folder without a readable config has no scores
            return None
    return value_of(folder.step_results(eval_id, step), metric) if eval_id else None


@dataclass(frozen=True)
class StepScores:
    """The checkpoints' evaluation of one cell: `save_at` and `protected` are what the training loop asks
    (train/checkpoint.py's Retention)."""

    folder: CellFolder
    cfg: CellConfig

    @property
    def steps(self) -> tuple[int, ...]:
        return self.cfg.checkpoint_steps()

    @property
    def eval_id(self) -> str | None:
        return self.cfg.checkpoint_eval_id()

    @property
    def save_at(self) -> frozenset[int]:
        return frozenset(self.steps)

    def results(self) -> dict[int, dict]:
        """The asked steps' results.json written so far, by step."""
        found = self.folder.step_evaluations(self.eval_id) if self.eval_id else {}
        return {s: r for s, r in found.items() if s in self.save_at}

    def done(self, step: int) -> bool:
        """Scored, or said unavailable: a step folder exists only once its evaluation is complete."""
        eval_id = self.eval_id
        return eval_id is not None and bool(self.folder.step_results(eval_id, step).get("complete"))

    def pending(self) -> list[int]:
        return [s for s in self.steps if not self.done(s)]

    def ready(self) -> list[int]:
        """Pending steps whose checkpoint is on disk: what an evaluator can take now."""
        saved = set(self.folder.checkpoint_steps())
        return [s for s in self.pending() if s in saved]

    def settled(self) -> bool:
        return not self.pending()

    # -- selection ------------------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        sel = self.cfg.train.select
        assert sel is not None
        return sel.mode or ("min" if TASKS[sel.metric].lower_is_better else "max")

    def scores(self, metric: str | None = None) -> dict[int, float]:
        """step -> the metric's value (train.select's metric by default), for the steps that have one."""
        metric = metric or (self.cfg.train.select.metric if self.cfg.train.select else "")
        found = {s: value_of(r, metric) for s, r in self.results().items()}
        return {s: v for s, v in found.items() if v is not None}

    def ranked(self) -> list[int]:
        """The scored steps, best first; a tie goes to the earlier step."""
        scores, sign = self.scores(), (-1 if self.mode == "max" else 1)
        return sorted(scores, key=lambda s: (sign * scores[s], s))

    def best(self) -> int | None:
        ranked = self.ranked()
        return ranked[0] if ranked else None

    def kept_for_selection(self) -> set[int]:
        """Evaluated checkpoints a selection keeps: the best train.keep_best, or all of them."""
        t = self.cfg.train
        if t.select is None:
            return set()
        if t.keep_best is None:
            return set(self.results())
        return set(self.ranked()[:t.keep_best])

    def protected(self) -> set[int]:
        """Checkpoints no rotation may delete now: those waiting for their evaluation, and a selection's."""
        return set(self.pending()) | self.kept_for_selection()
