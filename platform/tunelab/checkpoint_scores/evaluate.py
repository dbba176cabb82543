"""Checkpoint evaluation: `python -m tunelab.checkpoint_scores.evaluate RUN_DIR [--follow]`.

Scores the checkpoints a cell's eval.checkpoints asks for (checkpoint_scores/steps.py) into eval/<eval-id>/step-N/,
with evals.run (results.json with its provenance and marks, samples.jsonl), each on a one-process model built from the
checkpoint (train.peft.load_checkpoint). Beside training (`--follow`, started by the cell: evaluators.py) it
evaluates checkpoints as they appear until its stdin closes (the cell's training ended, or the cell died); alone
it evaluates what is on disk and exits. The cell itself calls `settle` once training is over.

Safe to kill at any moment: it holds no lock of the cell's (the trainer holds that), only one per step
(eval/<eval-id>/.step-N.lock, freed by the kernel when it dies); a step is evaluated into a temporary folder and
renamed into place once complete, so a killed evaluation leaves no step folder, and the next evaluator removes
what it left and evaluates that step again.
"""

from __future__ import annotations

import os
import select
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tunelab.checkpoint_scores.steps import StepScores
from tunelab.core import events
from tunelab.core.config import CellConfig, EvalCfg
from tunelab.core.errors import UserError
from tunelab.core.events import Emit
from tunelab.core.files import atomic_dir, write_json
from tunelab.folders.cell import CellFolder, EvalFolder, step_name

POLL_S = 1.0  # how often an evaluator beside training looks for a new checkpoint


def needs_data(ecfg: EvalCfg) -> bool:
    """Whether an evaluation needs the cell's datasets: val_loss its validation set, a stand-in its training
    set (checked for contamination)."""
    from tunelab.core.registries import TASKS

    return "val_loss" in ecfg.tasks or any(t in TASKS and TASKS[t].stand_in for t in ecfg.tasks)


def cell_data(cfg: CellConfig, tokenizer: Any) -> dict:
    from tunelab.core.paths import cache_dir
    from tunelab.data.build import build as build_data

    return build_data(cfg.data, tokenizer, cache_dir())


def context(folder: CellFolder, out_dir: Path, datasets: dict | None, val_loss: float | None = None) -> Any:
    """What evals.run needs besides the model: the cell's validation and training sets, its model note."""
    from tunelab import evals

    return evals.Context(out_dir=out_dir, validation=datasets["validation"] if datasets else None, val_loss=val_loss,
                         train=datasets["train"] if datasets else None,
                         model_note=folder.env().get("model", {}).get("note"))


def evaluate_saved(folder: CellFolder, cfg: CellConfig, step_dir: Path, ecfg: EvalCfg, out_dir: Path, rt: Any,
                   emit: Emit = events.ignore, datasets: dict | None = None) -> tuple[dict, dict | None]:
    """evals.run on checkpoint `step_dir` of the cell into out_dir -> (results, the datasets it built)."""
    from tunelab import evals
    from tunelab.train import peft

    model, tokenizer = peft.load_checkpoint(cfg, step_dir, rt)
    if datasets is None and needs_data(ecfg):
        datasets = cell_data(cfg, tokenizer)
    out = evals.run(peft.for_eval(model), tokenizer, ecfg, context(folder, out_dir, datasets), emit)
    return out, datasets


def evaluate_checkpoint(folder: CellFolder, step: int, ecfg: EvalCfg, out_dir: Path, device: str,
                        emit: Emit = events.ignore) -> dict:
    """`exp eval run CELL/checkpoints/step-N`: one checkpoint alone, as its cell would score it -> results."""
    from tunelab.machine import runtime
    from tunelab.machine.runtime import Layout

    cfg = folder.config()
    rt = runtime.resolve(cfg, Layout(device=runtime.device_of(device)))
    out, _ = evaluate_saved(folder, cfg, folder.checkpoint_dir(step), ecfg, out_dir, rt, emit)
    out = {**out, "step": step, "checkpoint": str(folder.checkpoint_dir(step)), "evaluated_by": "exp eval run"}
    write_json(EvalFolder(out_dir).results_file, out)
    return out


def evaluate_final(folder: CellFolder, ecfg: EvalCfg, out_dir: Path, device: str, emit: Emit = events.ignore) -> dict:
    """`exp eval run CELL`: its final/ weights (base + adapter for a PEFT cell), with its datasets where a task
    needs them, as the cell's own evaluation loads them -> results."""
    from tunelab import evals
    from tunelab.machine import runtime
    from tunelab.machine.runtime import Layout
    from tunelab.train import peft

    if not folder.is_trained():
        raise UserError(f"the cell has no final/ weights yet (state {folder.state()}); `exp run` its matrix first, or "
                        "evaluate one of its checkpoints (CELL/checkpoints/step-N)", file=folder.path)
    cfg = folder.config()
    rt = runtime.resolve(cfg, Layout(device=runtime.device_of(device)))
    model, tokenizer = peft.load_trained(cfg, folder.final, rt)
    datasets = cell_data(cfg, tokenizer) if needs_data(ecfg) else None
    out = evals.run(peft.for_eval(model), tokenizer, ecfg, context(folder, out_dir, datasets), emit)
    out = {**out, "cell": str(folder.path), "evaluated_by": "exp eval run"}
    write_json(EvalFolder(out_dir).results_file, out)
    return out


@dataclass
class Evaluator:
    """Evaluates a cell's asked checkpoints one step at a time, each under its own lock."""

    folder: CellFolder
    cfg: CellConfig
    by: str  # who evaluates, for results.json: "beside training", "the cell after training", ...
    emit: Emit = events.ignore
    _rt: Any = None
    _datasets: dict | None = field(default=None, repr=False)

    @property
    def scores(self) -> StepScores:
        return StepScores(self.folder, self.cfg)

    @property
    def ecfg(self) -> EvalCfg:
        ecfg = self.cfg.eval.at_checkpoints()
        assert ecfg is not None, "the cell has no eval.checkpoints"
        return ecfg

    def runtime(self) -> Any:
        if self._rt is None:
            from tunelab.machine import runtime
            from tunelab.machine.runtime import Layout

            self._rt = runtime.resolve(self.cfg, Layout(device=runtime.device_of(self.cfg.train.device)))
        return self._rt

    def step(self, step: int) -> bool:
        """Evaluate the checkpoint of `step` unless another evaluator has it or it is done -> whether it did."""
        eval_id = self.ecfg.id()
        claim = self.folder.step_claim(eval_id, step)
        if not claim.acquire(wait=0):
            return False
        with claim:
            if self.scores.done(step) or not self.folder.checkpoint_dir(step).is_dir():
                return False
            clear_halves(self.folder, eval_id, step)
            self._evaluate(step)
        return True

    def _evaluate(self, step: int) -> None:
        t0 = time.perf_counter()
        with atomic_dir(self.folder.step_dir(self.ecfg.id(), step)) as tmp:
            try:
                out, self._datasets = evaluate_saved(self.folder, self.cfg, self.folder.checkpoint_dir(step),
                                                     self.ecfg, tmp, self.runtime(), tagged(self.emit, step),
                                                     self._datasets)
            except UserError as e:  # an unreadable checkpoint: no evaluator will do better, say so
                out = self.unavailable(f"checkpoint unreadable: {e}")
            write_json(EvalFolder(tmp).results_file, {**out, **mark(self.folder, step, self.by),
                                                      "seconds": time.perf_counter() - t0})
        say(f"step {step} evaluated in {time.perf_counter() - t0:.1f} s ({self.by})")

    def unavailable(self, reason: str) -> dict:
        """A step's results when it cannot be scored: every task unavailable with the reason."""
        tasks = {t: {"task": t, "status": "unavailable", "reason": reason, "value": None, "stderr": None, "n": 0}
                 for t in self.ecfg.tasks}
        return {"tasks": tasks, "config": self.ecfg.model_dump(mode="json"), "complete": True}

    def missing(self, step: int) -> None:
        """A step whose checkpoint training never saved (or that was deleted): unavailable, for good."""
        reason = (f"no checkpoint of step {step} in checkpoints/: the cell trained before its evaluation asked for "
                  "it (train.save_every, train.keep_checkpoints), or it was deleted; scoring it needs training again")
        with atomic_dir(self.folder.step_dir(self.ecfg.id(), step)) as tmp:
            write_json(EvalFolder(tmp).results_file, {**self.unavailable(reason), "step": step, "checkpoint": None})


def clear_halves(folder: CellFolder, eval_id: str, step: int) -> None:
    """What a killed evaluator left of a step's evaluation (its temporary folders), removed."""
    for half in folder.eval_dir(eval_id).glob(f".{step_name(step)}-*"):
        shutil.rmtree(half, ignore_errors=True)


def tagged(emit: Emit, step: int) -> Emit:
    """`emit` with a checkpoint's tasks saying which step they score."""
    return lambda ev: emit(replace(ev, step=step) if isinstance(ev, events.EvalTask) else ev)


def mark(folder: CellFolder, step: int, by: str) -> dict:
    """What a checkpoint's results.json says of where it came from and who scored it."""
    return {"step": step, "checkpoint": str(folder.checkpoint_dir(step).relative_to(folder.path)), "evaluated_by": by,
            "pid": os.getpid()}


def settle(folder: CellFolder, cfg: CellConfig, emit: Emit = events.ignore, rt: Any = None,
           upto: int | None = None) -> StepScores:
    """Once training is over (in the cell's process): evaluate every asked checkpoint no evaluator finished, and
    say the ones never saved are unavailable. `upto`: training paused at that step (a search's rung), so only
    the steps up to it are settled; the later ones are still to be trained."""
    ev = Evaluator(folder, cfg, "the cell, after training" if upto is None else f"the cell, paused at step {upto}",
                   emit, rt)
    scores = ev.scores

    def due(steps: list[int]) -> list[int]:
        return [s for s in steps if upto is None or s <= upto]

    for step in due(scores.ready()):
        while not ev.step(step) and step in scores.ready():  # another evaluator has it: wait for it
            time.sleep(POLL_S)
    saved = set(folder.checkpoint_steps())
    for step in due(scores.pending()):
        if step not in saved:
            ev.missing(step)
    return scores


def say(message: str) -> None:
    print(f"tunelab checkpoint evaluation (pid {os.getpid()}): {message}", file=sys.stderr, flush=True)


def _closed(timeout: float) -> bool:
    """Whether stdin reached its end within `timeout` s: the cell that started this evaluator says training is
    over by closing it (so does the kernel when the cell dies)."""
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    return bool(ready) and os.read(sys.stdin.fileno(), 4096) == b""


def work(folder: CellFolder, follow: bool) -> int:
    """Evaluate ready checkpoints until none is left; `follow`: until stdin closes, then once more."""
    ev = Evaluator(folder, folder.config(), "beside training" if follow else f"python -m {__spec__.name}")
    ended = not follow
    while True:
        if [s for s in ev.scores.ready() if ev.step(s)]:
            continue
        if ended:
            return 0
        ended = _closed(POLL_S)


def main(argv: list[str] | None = None) -> int:
    from tunelab.machine.threads import start_process

    start_process()  # before torch loads: the threads its cell left it (evaluators.Beside), its waiting policy
    argv = sys.argv[1:] if argv is None else argv
    follow = "--follow" in argv
    args = [a for a in argv if a != "--follow"]
    if len(args) != 1:
        print("usage: python -m tunelab.checkpoint_scores.evaluate RUN_DIR [--follow]", file=sys.stderr)
        return 2
    folder = CellFolder(Path(args[0]).resolve())
    if not folder.exists() or folder.config().eval.checkpoints is None:
        print(f"{folder.path}: not a cell folder with eval.checkpoints", file=sys.stderr)
        return 2
    say(f"started for {folder.path}" + (" beside training" if follow else ""))
    return work(folder, follow)


if __name__ == "__main__":
    sys.exit(main())
