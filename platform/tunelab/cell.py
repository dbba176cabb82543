"""One cell, end to end: `python -m tunelab.cell RUN_DIR`.

Reads RUN_DIR/config.yaml, checks what this machine must offer, and runs the stages: model, data, PEFT,
train (on every process of the layout), then the evaluation named by the config's eval section on the main
process. A cell whose training is done (final/ weights, status `trained`) only evaluates, on one process:
adding a task to a finished matrix trains nothing again (cellfolder.py). Progress events (tunelab.events) go to
stdout as JSON lines for whoever launched it; everything else a library prints is sent to stderr, so it
cannot corrupt that stream.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab import events
from tunelab.cellfolder import CellFolder
from tunelab.config import CellConfig
from tunelab.errors import UserError
from tunelab.events import Emit, Stage
from tunelab.launch import stop_at_from_env, validate_at_from_env
from tunelab.runtime import Layout, Paused, Preempted, Runtime
from tunelab.store import write_json

if TYPE_CHECKING:
    from tunelab.models import Weights
    from tunelab.tracking import Tracker


def _event_stream() -> Emit:
    """Keep the real stdout for events and point fd 1 at stderr for everything else."""
    stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    listening = True

    def emit(event) -> None:
        nonlocal listening
        if listening:
            try:
                stream.write(events.encode(event) + "\n")
            except BrokenPipeError:  # the launcher went away: the work (and its files) still count
                listening = False

    return emit


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


@dataclass
class CellRun:
    """One attempt at a cell on one process of its layout: what every stage needs."""

    folder: CellFolder
    cfg: CellConfig
    rt: Runtime
    emit: Emit
    timings: dict[str, float] = field(default_factory=dict)
    tracker: Tracker | None = None  # the main process's W&B run; None on the others
    stop_at: int | None = None  # this run trains up to this step only (a search's rung; launch.STOP_AT_ENV)
    validate_at: tuple[int, ...] = ()  # and measures validation loss at these steps (its search's rungs)

    def track(self, resuming: bool) -> None:
        """Open the W&B run of this cell; its events reach W&B from now on."""
        from tunelab.tracking import Tracker

        meta = self.folder.meta()
        tracker = self.tracker = Tracker(
            self.cfg, self.folder.path, group=meta.get("matrix", "adhoc"), name=meta.get("slug", self.folder.path.name),
            config=self.cfg.model_dump(mode="json"), tags=[f"{k}={v}" for k, v in meta.get("varying", {}).items()],
            resuming=resuming)
        emit = self.emit

        def both(event: events.Event) -> None:
            tracker.on_event(event)
            emit(event)

        self.emit = both

    def summary(self, values: dict) -> None:
        if self.tracker is not None:
            self.tracker.summary(values)

    def finish(self, failed: bool = False) -> None:
        if self.tracker is not None:
            self.tracker.finish(failed=failed)


def _load(run: CellRun) -> tuple[Any, Any, Weights | None]:
    """The model as the layout builds it (train.parallel.init_mode) and the tokenizer -> (model, tokenizer,
    checkpoint files when the model is on the meta device). The model is built from the same files either way."""
    from tunelab import models
    from tunelab.train import parallel, peft

    cfg, rt = run.cfg, run.rt
    safetensors = rt.layout.distributed and any(models.folder(cfg.model).glob("*.safetensors"))
    mode, why = parallel.init_mode(cfg, rt.layout, safetensors)
    if rt.layout.distributed:
        print(f"model init: {mode} ({why})", file=sys.stderr)
    if mode == "meta":
        return models.empty(cfg.model, rt.dtype, rt.attn), models.tokenizer(cfg.model), \
            models.Weights(models.folder(cfg.model))
    if mode == "zero3":
        return parallel.load_partitioned(cfg.model, rt, cfg), models.tokenizer(cfg.model), None
    return (*models.load(cfg.model, rt, **peft.load_kwargs(cfg.peft, rt.device)), None)


def _build_data(run: CellRun, tokenizer: Any) -> dict:
    """The cell's datasets: the main process builds the cache once, the others read it."""
    from tunelab.data.build import build as build_data
    from tunelab.paths import cache_dir

    run.emit(Stage("data"))
    if not run.rt.is_main:
        _barrier()
    datasets = build_data(run.cfg.data, tokenizer, cache_dir(),
                          progress=lambda done, total: run.emit(events.DataProgress(done, total)))
    if run.rt.is_main:
        _barrier()
    return datasets


def _train(run: CellRun) -> tuple[Any, Any, dict, float | None]:
    """Load, build data, wrap, train on every process. -> (trained model, tokenizer, datasets, val loss)."""
    import torch
    from transformers import set_seed

    from tunelab import along, train
    from tunelab.data import build  # noqa: F401 - imported before the baseline below: libraries are not training
    from tunelab.stepscores import StepScores
    from tunelab.train import parallel, peft
    from tunelab.train.validation import Validation

    cfg, rt, t0 = run.cfg, run.rt, time.perf_counter()
    rss_before = _rss_mb()  # what the process holds before the model: `exp memory` predicts what training adds
    run.emit(Stage("load"))
    # The one seed of a cell. Loading and data building run on forks of it: what a layout's way of building
    # the model draws, or a data cache miss (a hit draws nothing), leaves the adapters' init and the training's
    # draws the same on every layout and every run.
    set_seed(cfg.train.seed)
    with torch.random.fork_rng(devices=[]):
        model, tokenizer, files = _load(run)
        datasets = _build_data(run, tokenizer)
    weights = None
    if files is None:
        model = peft.apply(model, cfg.peft)
    else:  # adapters initialised for real, the base weights read per shard by the engine
        model, weights = parallel.with_adapters(model, lambda m: peft.apply(m, cfg.peft), files)
    run.timings["setup_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with along.evaluators(run.folder, cfg, rt):  # checkpoint evaluators beside training (eval.checkpoints)
        result = train.run(model, tokenizer, datasets, cfg, run.folder, run.emit, runtime=rt,
                           validation=Validation.of(cfg.eval), weights=weights, retention=StepScores(run.folder, cfg),
                           stop_at=run.stop_at, validate_at=run.validate_at)
        run.timings["train_s"] = time.perf_counter() - t0
    before = _gather(rss_before)
    selected = False  # final/ holds another step's weights than the last (train.select)
    if rt.is_main:
        write_json(run.folder.memory_file, {
            "kind": result.peak_mem_kind, "peak_mb": result.peak_mem_mb_ranks, "rss_before_load_mb": before})
        selected = along.after_training(run.folder, cfg, rt, run.emit, result.model, tokenizer, run.timings)
        run.folder.write_status("running", timings=run.timings, trained=cfg.train.save_final)
        run.summary({f"train/{k}": v for k, v in result.summary().items()})
    return result.model, tokenizer, datasets, None if selected else result.val_loss


def _rss_mb() -> float:
    """This process's resident memory now (the baseline its load and training add to)."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _gather(value: float) -> list[float]:
    import torch.distributed as dist

    if not dist.is_initialized():
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _load_trained(run: CellRun) -> tuple[Any, Any, dict | None, float | None] | None:
    """The saved final/ weights (base + adapter for PEFT cells) and the datasets, for another evaluation; first
    the checkpoints' evaluation. None when the final evaluation is done already (only checkpoints were new)."""
    from tunelab import along, ckpteval
    from tunelab.train import peft
    from tunelab.train.validation import Validation

    if run.cfg.eval.checkpoints is not None:
        along.score(run.folder, run.cfg, run.rt, run.emit)  # the checkpoints it has (a new eval.checkpoints)
    if run.folder.eval_done(run.cfg.eval.id()):
        return None
    run.emit(Stage("load"))
    model, tokenizer = peft.load_trained(run.cfg, run.folder.final, run.rt)
    summary = run.folder.summary()
    # The training stage's final validation loss counts when it was measured the way this evaluation asks, on
    # the weights final/ holds (not when a selection put another step's there).
    same = summary.get("validation") == Validation.of(run.cfg.eval).settings() and \
        run.folder.selection().get("step", run.cfg.train.steps) == run.cfg.train.steps
    datasets = ckpteval.cell_data(run.cfg, tokenizer) if ckpteval.needs_data(run.cfg.eval) else None
    return model, tokenizer, datasets, summary.get("val_loss") if same else None


def _evaluate(run: CellRun, model: Any, tokenizer: Any, datasets: dict | None, val_loss: float | None) -> None:
    from tunelab import ckpteval, evals
    from tunelab.report.scores import Score, wandb_key, wandb_value
    from tunelab.train import peft

    t0 = time.perf_counter()
    ctx = ckpteval.context(run.folder, run.folder.eval_dir(run.cfg.eval.id()), datasets, val_loss)
    scores = evals.run(peft.for_eval(model), tokenizer, run.cfg.eval, ctx, run.emit)
    run.timings["eval_s"] = time.perf_counter() - t0
    shown = [Score.of(task, res) for task, res in scores["tasks"].items()]  # marks travel to W&B too
    run.summary({wandb_key(s): v for s in shown if (v := wandb_value(s)) is not None})


def _start(run: CellRun, evaluate_only: bool) -> None:
    """The main process says the cell runs, keeps the machine's description and opens the W&B run."""
    from tunelab import env

    folder = run.folder
    if evaluate_only:  # keep the training's timings beside this evaluation's
        run.timings.update(folder.status().get("timings") or {})
    write_json(folder.env_file, env.snapshot(run.cfg.model.name))
    folder.write_status("running", started_at=time.time(), pid=os.getpid(), timings=run.timings,
                        world_size=run.rt.world_size, evaluating_only=evaluate_only, paused_at=None, note=None)
    run.track(resuming=evaluate_only or _has_checkpoint(folder, run.cfg))


def run_cell(run_dir: Path, emit: Emit = events.ignore, cfg: CellConfig | None = None,
             layout: Layout | None = None) -> None:
    """The stages of one cell, on every process of its layout; only the main process writes files.
    Without cfg and layout: read RUN_DIR/config.yaml and run as one plain process (or evaluate only)."""
    from tunelab import runtime

    folder = CellFolder(run_dir)
    cfg = cfg or folder.config()
    evaluate_only = folder.is_trained()
    layout = layout or Layout(device=runtime.device_of(cfg.train.device))
    run = CellRun(folder, cfg, runtime.resolve(cfg, layout), emit, stop_at=stop_at_from_env(),
                  validate_at=validate_at_from_env())
    main = layout.is_main
    if main:
        _start(run, evaluate_only)
    try:
        runtime.check_host(cfg, file=folder.config_file)
        paused = None
        try:
            stages = _load_trained(run) if evaluate_only else _train(run)
        except Paused as e:  # a search's rung: validated and checkpointed there
            paused = e.step  # (handled once the exception, and the training model its frames hold, are gone)
        if paused is not None:
            _pause(run, paused)
        elif main:  # evaluation needs the whole model: one process does it while the others wait
            if stages is not None:  # None: only checkpoints were left to score (_load_trained did)
                _evaluate(run, *stages)
            run.finish()
            folder.write_status("done", finished_at=time.time(), timings=run.timings)
        _barrier()
    except Preempted as e:  # a stop signal: checkpoint written (when training), run again later
        _preempted(run, e)
        raise
    except KeyboardInterrupt:
        if main:  # interrupted, not broken: the next `exp run` picks it up (from its last checkpoint)
            run.finish(failed=True)
            folder.write_status("pending", finished_at=time.time(), timings=run.timings, note="interrupted")
        raise
    except BaseException as e:
        if main:
            run.finish(failed=True)
            folder.write_status("failed", finished_at=time.time(), timings=run.timings,
                                error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(),
                                bad_input=isinstance(e, UserError))
        raise


def _pause(run: CellRun, step: int) -> None:
    """Stopped at a search's rung: the checkpoints up to it scored (a search that ranks its rungs by a checkpoint
    score reads them; W&B gets them when training ends), then pending until the search decides it goes on."""
    from tunelab import ckpteval

    if not run.rt.is_main:
        return
    if run.cfg.eval.checkpoints is not None:
        t0 = time.perf_counter()
        ckpteval.settle(run.folder, run.cfg, run.emit, run.rt, upto=step)
        run.timings["checkpoints_s"] = run.timings.get("checkpoints_s", 0.0) + time.perf_counter() - t0
    run.finish()
    run.folder.write_status("pending", finished_at=time.time(), timings=run.timings, paused_at=step,
                            note=f"paused at step {step} by its search (exp tune): it continues from there if promoted")


def _preempted(run: CellRun, e: Preempted) -> None:
    _stopping()
    main = run.rt.is_main
    if main:
        run.finish(failed=True)
        job = _requeue_target()
        run.folder.write_status("pending", finished_at=time.time(), timings=run.timings,
                                note=f"{e}; " + (f"requeued (SLURM job {job})" if job else "run it again to resume"))
    if e.step is not None:  # every rank stopped at the same step: leave together, then requeue
        _barrier()
    if main:
        _requeue()
    e.handled = True  # for main(): the requeue is done


def _stopping() -> None:
    """Once stopping, further stop signals (SLURM repeats them; requeueing sends SIGTERM) change nothing."""
    import signal

    from tunelab.runtime import STOP_SIGNALS

    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def _requeue_target() -> str | None:
    """This process's SLURM job (an array task has its own id), or None outside SLURM."""
    return os.environ.get("SLURM_JOB_ID")


def _requeue() -> None:
    """Put the SLURM job back in the queue: it runs the same batch script again, which resumes the cell from
    its checkpoint. SLURM ends this run of the job when it requeues it."""
    import subprocess

    job = _requeue_target()
    if job:
        out = subprocess.run(["scontrol", "requeue", job], check=False, capture_output=True, text=True)
        print(f"scontrol requeue {job}: exit {out.returncode} {out.stderr.strip()}", file=sys.stderr)


def _has_checkpoint(folder: CellFolder, cfg: CellConfig) -> bool:
    from tunelab.train import checkpoint

    return cfg.train.resume and checkpoint.latest(folder.checkpoints) is not None


LOCK_WAIT_S = 10.0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tunelab.cell RUN_DIR", file=sys.stderr)
        return 2
    from contextlib import nullcontext

    from tunelab.runtime import catch_stop_signals
    from tunelab.store import LOCK_HELD_ENV, LOCKED_EXIT, Locked, lock, lock_holder
    from tunelab.train import parallel

    folder = CellFolder(Path(argv[0]).resolve())
    emit = _event_stream()
    catch_stop_signals()  # SIGUSR1 / SIGTERM: checkpoint at the next step boundary, mark pending, requeue
    try:
        cfg = folder.config()
        # A trained cell only evaluates, on one process; training joins torchrun's process group.
        layout = None if folder.is_trained() else parallel.setup(cfg.parallel)
        if layout is not None and not layout.is_main:
            emit = events.ignore  # events come from the main process only
        # The runner holds the folder's lock for the cell it starts; started any other way, the main process
        # takes it, waiting a moment for a process that only looks (store.is_locked).
        must_lock = (layout is None or layout.is_main) and os.environ.get(LOCK_HELD_ENV) != str(folder.path)
        with lock(folder.path, wait=LOCK_WAIT_S) if must_lock else nullcontext():
            run_cell(folder.path, emit, cfg, layout)
    except Locked:
        print(f"{folder.path} is locked by {lock_holder(folder.path)}", file=sys.stderr)
        return LOCKED_EXIT
    except Preempted as e:  # not a failure: status.json says pending, the checkpoint is in place
        print(f"stopped: {e}", file=sys.stderr)
        if not getattr(e, "handled", False) and int(os.environ.get("RANK", "0")) == 0:
            _requeue()  # stopped before run_cell could (while joining the process group)
        return 0
    except Exception:  # noqa: BLE001 - the traceback goes to cell.log, the exit code says failed
        traceback.print_exc()
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
