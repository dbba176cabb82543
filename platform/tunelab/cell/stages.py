"""One cell, end to end, on every process of its layout (`python -m tunelab.cell RUN_DIR`: cell/process.py).

Reads the cell's config, checks what this machine must offer, and runs the stages: the training assembled top to
bottom (cell/assembly.py: model, data, PEFT, the loop's stepper and optimizer, checkpoint evaluators) and trained
on every process, then the evaluation named by the config's eval section on the main process (cell/evaluation.py).
A cell whose training is done (final/ weights, status `trained`) only evaluates, on one process: adding a task to
a finished matrix trains nothing again (folders/cell.py). Only the main process writes files and events.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from tunelab.cell import evaluation
from tunelab.cell.assembly import assemble, barrier
from tunelab.cell.attempt import Attempt, start
from tunelab.checkpoint_scores import cell_side
from tunelab.core import events
from tunelab.core.config import CellConfig
from tunelab.core.errors import UserError
from tunelab.core.events import Emit
from tunelab.core.files import write_failure, write_json
from tunelab.machine.runtime import Layout, Paused, Preempted


def _train(attempt: Attempt) -> tuple[Any, Any, dict, float | None]:
    """Assemble and train on every process. -> (trained model, tokenizer, datasets, val loss)."""
    from tunelab.train import loop

    run = assemble(attempt)
    cfg, rt, t0 = attempt.cfg, attempt.rt, time.perf_counter()
    with run.evaluators:  # checkpoint evaluators beside training (eval.checkpoints)
        result = loop.train(run.training)
        attempt.timings["train_s"] = time.perf_counter() - t0
    before = _gather(run.rss_before_mb)
    selected = False  # final/ holds another step's weights than the last (train.select)
    if rt.is_main:
        write_json(attempt.folder.memory_file, {
            "kind": result.peak_mem_kind, "peak_mb": result.peak_mem_mb_ranks, "rss_before_load_mb": before})
        selected = cell_side.after_training(attempt.folder, cfg, rt, attempt.emit, result.model, run.tokenizer,
                                            attempt.timings)
        attempt.folder.write_status("running", timings=attempt.timings, trained=cfg.train.save_final)
        attempt.summary({f"train/{k}": v for k, v in result.summary().items()})
    return result.model, run.tokenizer, run.datasets, None if selected else result.val_loss


def _gather(value: float) -> list[float]:
    import torch.distributed as dist

    if not dist.is_initialized():
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def run_cell(run_dir: Path, emit: Emit = events.ignore, cfg: CellConfig | None = None,
             layout: Layout | None = None) -> None:
    """The stages of one cell, on every process of its layout; only the main process writes files.
    Without cfg and layout: read RUN_DIR/config.yaml and run as one plain process (or evaluate only)."""
    from tunelab.machine.runtime import check_host

    attempt = Attempt.open(run_dir, emit, cfg, layout)
    folder, cfg, main, evaluate_only = attempt.folder, attempt.cfg, attempt.rt.is_main, attempt.folder.is_trained()
    try:
        if main:  # inside: a start-up that fails (env.json unwritable, W&B) fails the cell with its cause
            start(attempt, evaluate_only)
        check_host(cfg, file=folder.config_file)
        paused = None
        try:
            stages = evaluation.load_trained(attempt) if evaluate_only else _train(attempt)
        except Paused as e:  # a search's rung: validated and checkpointed there
            paused = e.step  # (handled once the exception, and the training model its frames hold, are gone)
        if paused is not None:
            _pause(attempt, paused)
        elif main:  # evaluation needs the whole model: one process does it while the others wait
            if stages is not None:  # None: only checkpoints were left to score (load_trained did)
                evaluation.run(attempt, *stages)
            attempt.finish()
            folder.write_status("done", finished_at=time.time(), timings=attempt.timings)
        barrier()
    except Preempted as e:  # a stop signal: checkpoint written (when training), run again later
        _preempted(attempt, e)
        raise
    except KeyboardInterrupt:
        if main:  # interrupted, not broken: the next `exp run` picks it up (from its last checkpoint)
            attempt.finish(failed=True)
            folder.write_status("pending", finished_at=time.time(), timings=attempt.timings, note="interrupted")
        raise
    except BaseException as e:
        if main:
            _failed(attempt, e)
        raise


def _failed(attempt: Attempt, e: BaseException) -> None:
    """status.json says failed, why, and, when a write failed, which limit it met (a full disk, a quota, a
    read-only folder, `ulimit -f`: a plain `exp run` retries such a cell). When even that cannot be written (the
    disk still full), cell.log says so and the runner records the failure."""
    cause = write_failure(e, attempt.folder.path)
    fields: dict[str, Any] = {"finished_at": time.time(), "timings": attempt.timings,
                              "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(),
                              "bad_input": isinstance(e, UserError) and cause is None}
    if cause is not None:
        fields["write_failed"] = cause
    for what, do in (("end the W&B run", lambda: attempt.finish(failed=True)),
                     ("record the failure in status.json", lambda: attempt.folder.write_status("failed", **fields))):
        try:
            do()
        except Exception as again:  # noqa: BLE001 - the first failure is the one raised; this one is said
            print(f"could not {what}: {type(again).__name__}: {again}", file=sys.stderr)


def _pause(attempt: Attempt, step: int) -> None:
    """Stopped at a search's rung: the checkpoints up to it scored (a search that ranks its rungs by a checkpoint
    score reads them; W&B gets them when training ends), then pending until the search decides it goes on."""
    if not attempt.rt.is_main:
        return
    evaluation.checkpoints_upto(attempt, step)
    attempt.finish()
    attempt.folder.write_status("pending", finished_at=time.time(), timings=attempt.timings, paused_at=step,
                                note=f"paused at step {step} by its search (exp tune): it continues from there if "
                                     "promoted")


def _preempted(attempt: Attempt, e: Preempted) -> None:
    _stopping()
    main = attempt.rt.is_main
    if main:
        attempt.finish(failed=True)
        job = requeue_target()
        again = f"requeued (SLURM job {job})" if job else "run it again to resume"
        attempt.folder.write_status("pending", finished_at=time.time(), timings=attempt.timings, note=f"{e}; {again}")
    if e.step is not None:  # every rank stopped at the same step: leave together, then requeue
        barrier()
    if main:
        requeue()
    e.handled = True  # for main(): the requeue is done


def _stopping() -> None:
    """Once stopping, further stop signals (SLURM repeats them; requeueing sends SIGTERM) change nothing."""
    import signal

    from tunelab.machine.runtime import STOP_SIGNALS

    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def requeue_target() -> str | None:
    """This process's SLURM job (an array task has its own id), or None outside SLURM."""
    return os.environ.get("SLURM_JOB_ID")


def requeue() -> None:
    """Put the SLURM job back in the queue: it runs the same batch script again, which resumes the cell from
    its checkpoint. SLURM ends this run of the job when it requeues it."""
    import subprocess

    job = requeue_target()
    if job:
        out = subprocess.run(["scontrol", "requeue", job], check=False, capture_output=True, text=True)
        print(f"scontrol requeue {job}: exit {out.returncode} {out.stderr.strip()}", file=sys.stderr)
