"""What a cell does about scores along training (eval.checkpoints, train.select), on its main process.

Before training: the evaluators beside it (checkpoint_scores/evaluators.py), when eval.checkpoints.workers (or the
device) says so. After training: every asked checkpoint scored (evaluate.settle), the scores sent to W&B and the
runner at their steps, the best checkpoint made final/ (train.select), and the checkpoints no longer needed deleted. A
cell that only evaluates (trained before) scores the checkpoints it has, and deletes nothing. """

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from tunelab.checkpoint_scores import evaluate
from tunelab.checkpoint_scores.evaluators import Beside
from tunelab.checkpoint_scores.steps import StepScores
from tunelab.core.config import CellConfig
from tunelab.core.events import CheckpointScores, Emit
from tunelab.core.files import write_json
from tunelab.folders.cell import CellFolder


def evaluators(folder: CellFolder, cfg: CellConfig, rt: Any) -> AbstractContextManager:
    """The evaluators to run beside training (none on other ranks, without eval.checkpoints, with workers 0, or
    when every asked checkpoint is scored already)."""
    ck = cfg.eval.checkpoints
    if ck is None or not rt.is_main:
        return nullcontext()
    workers = ck.workers_on(rt.device.type == "cuda")
    if workers == 0 or StepScores(folder, cfg).settled():
        return nullcontext()
    return Beside(folder, workers)


def score(folder: CellFolder, cfg: CellConfig, rt: Any, emit: Emit) -> StepScores:
    """Every asked checkpoint scored or said unavailable, and each step's scores sent out (W&B, the runner)."""
    from tunelab.report.scores import Score, wandb_key, wandb_value

    scores = evaluate.settle(folder, cfg, emit, rt)
    for step, res in sorted(scores.results().items()):
        shown = (Score.of(t, r) for t, r in (res.get("tasks") or {}).items())
        emit(CheckpointScores(step, {wandb_key(s, "checkpoint"): wandb_value(s) for s in shown}))
    return scores


def after_training(folder: CellFolder, cfg: CellConfig, rt: Any, emit: Emit, model: Any, tokenizer: Any,
                   timings: dict[str, float]) -> bool:
    """Scores, selection and pruning once training ended -> whether final/ changed from the last step's weights
    (`model` then holds the chosen checkpoint's)."""
    from tunelab.train import checkpoint

    if cfg.eval.checkpoints is None:
        return False
    t0 = time.perf_counter()
    scores = score(folder, cfg, rt, emit)
    changed = select(folder, cfg, scores, model, tokenizer) if cfg.train.select is not None else False
    checkpoint.prune(folder.checkpoints, cfg.train.keep_checkpoints, scores.protected())
    timings["checkpoints_s"] = timings.get("checkpoints_s", 0.0) + time.perf_counter() - t0  # (a group's share too)
    return changed


def select(folder: CellFolder, cfg: CellConfig, scores: StepScores, model: Any, tokenizer: Any) -> bool:
    """final/ = the checkpoint that scores best on train.select's metric; train/selection.json says which."""
    from tunelab.train import checkpoint

    sel, last = cfg.train.select, cfg.train.steps
    assert sel is not None
    best = scores.best()
    record: dict[str, Any] = {"metric": sel.metric, "mode": scores.mode, "eval_id": scores.eval_id,
                              "scores": {str(s): v for s, v in sorted(scores.scores().items())},
                              "step": last if best is None else best, "last_step": last}
    if best is None:
        record["note"] = f"no checkpoint has a score of {sel.metric}: final/ keeps the last step's weights"
    if best is None or best == last:
        write_json(folder.selection_file, record)
        return False

    def write(d: Path) -> None:
        model.save_pretrained(d)
        tokenizer.save_pretrained(d)

    checkpoint.load_weights(model, folder.checkpoint_dir(best))
    if cfg.train.save_final:
        folder.replace_final(write)
    write_json(folder.selection_file, record)
    return True
