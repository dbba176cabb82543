"""A cell's final evaluation on its main process: of the model it just trained, or of the final/ weights it saved
before (a new eval section on a finished matrix trains nothing); the checkpoints' scores first."""

from __future__ import annotations

import time
from typing import Any

from tunelab.cell.attempt import Attempt
from tunelab.checkpoint_scores import cell_side, evaluate
from tunelab.core.events import Stage


def load_trained(attempt: Attempt) -> tuple[Any, Any, dict | None, float | None] | None:
    """The saved final/ weights (base + adapter for PEFT cells) and the datasets, for another evaluation; first
    the checkpoints' evaluation. None when the final evaluation is done already (only checkpoints were new)."""
    from tunelab.train import peft
    from tunelab.train.validation import Validation

    folder, cfg = attempt.folder, attempt.cfg
    if cfg.eval.checkpoints is not None:
        cell_side.score(folder, cfg, attempt.rt, attempt.emit)  # the checkpoints it has (a new eval.checkpoints)
    if folder.eval_done(cfg.eval.id()):
        return None
    attempt.emit(Stage("load"))
    model, tokenizer = peft.load_trained(cfg, folder.final, attempt.rt)
    summary = folder.summary()
    # The training stage's final validation loss counts when it was measured the way this evaluation asks, on
    # the weights final/ holds (not when a selection put another step's there).
    same = summary.get("validation") == Validation.of(cfg.eval).settings() and \
        folder.selection().get("step", cfg.train.steps) == cfg.train.steps
    datasets = evaluate.cell_data(cfg, tokenizer) if evaluate.needs_data(cfg.eval) else None
    return model, tokenizer, datasets, summary.get("val_loss") if same else None


def run(attempt: Attempt, model: Any, tokenizer: Any, datasets: dict | None, val_loss: float | None,
        unmerged: bool = False) -> None:
    """The eval section's suite on the model into eval/<eval-id>/; its scores to W&B (marks included).
    `unmerged`: the model is evaluated as given, its adapter not merged (a together-group's member: the base
    is shared, cell/group.py)."""
    from tunelab import evals
    from tunelab.train import peft

    t0 = time.perf_counter()
    ctx = context(attempt, datasets, val_loss)
    scores = evals.run(model if unmerged else peft.for_eval(model), tokenizer, attempt.cfg.eval, ctx, attempt.emit)
    scored(attempt, scores, time.perf_counter() - t0)


def run_together(attempts: list[Attempt], model: Any, adapters: list[str], tokenizer: Any, datasets: dict | None,
                 val_losses: list[float | None]) -> None:
    """Several members of a together-group that share an eval section, scored in shared passes over the unmerged
    base (evals.run_together: each row through its own adapter, each results.json what the member alone writes).
    Each member's eval_s is its share of the group's time; its progress shows the group's."""
    from tunelab import evals

    t0 = time.perf_counter()
    contexts = [context(a, datasets, v) for a, v in zip(attempts, val_losses)]

    def emit(event: Any) -> None:
        for a in attempts:
            a.emit(event)

    results = evals.run_together(model, tokenizer, attempts[0].cfg.eval, contexts, adapters, emit)
    share = (time.perf_counter() - t0) / len(attempts)  # each member's share of the shared passes
    for attempt, scores in zip(attempts, results):
        scored(attempt, scores, share)


def context(attempt: Attempt, datasets: dict | None, val_loss: float | None) -> Any:
    folder = attempt.folder
    return evaluate.context(folder, folder.eval_dir(attempt.cfg.eval.id()), datasets, val_loss)


def scored(attempt: Attempt, scores: dict, seconds: float) -> None:
    """An evaluation's scores to the attempt: its time, and W&B's summary (marks included)."""
    from tunelab.report.scores import Score, wandb_key, wandb_value

    attempt.timings["eval_s"] = seconds
    shown = [Score.of(task, res) for task, res in scores["tasks"].items()]  # marks travel to W&B too
    attempt.summary({wandb_key(s): v for s in shown if (v := wandb_value(s)) is not None})


def checkpoints_upto(attempt: Attempt, step: int) -> None:
    """A search's rung: the checkpoints up to `step` scored (a search that ranks its rungs by a checkpoint score
    reads them)."""
    if attempt.cfg.eval.checkpoints is not None:
        t0 = time.perf_counter()
        evaluate.settle(attempt.folder, attempt.cfg, attempt.emit, attempt.rt, upto=step)
        attempt.timings["checkpoints_s"] = attempt.timings.get("checkpoints_s", 0.0) + time.perf_counter() - t0
