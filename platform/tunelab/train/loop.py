"""train.run(model, tokenizer, datasets, cfg, folder) -> TrainResult: the training loop.

The loop keeps the data order, the schedule, logging and checkpoint bookkeeping; a Stepper does each step
(train/parallel: one process or a parallel engine). Per optimizer step: `grad_accum` micro-batches, loss =
sum of token losses / label tokens of the whole step (transformers' Trainer normalization), clipping,
optimizer and scheduler step, one metrics.jsonl record. Every `save_every` steps a checkpoint; a run that
finds one resumes from it exactly. What it needs of the evaluation (validation batches) comes as an argument.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tunelab.core.config import CellConfig
from tunelab.core.errors import UserError
from tunelab.core.events import Emit, Resumed, Step, ignore
from tunelab.core.files import append_jsonl, read_jsonl, warn, write_json, write_text
from tunelab.core.registries import uses_engine
from tunelab.folders.cell import CellFolder
from tunelab.machine import collector
from tunelab.machine.load import CpuMeter
from tunelab.machine.runtime import STOP, Layout, Paused, Preempted, Runtime, precision_of, stop_agreed
from tunelab.optimizers.tied import prepare_for_fused
from tunelab.train import checkpoint, cpu_attention, optim, parallel, segments
from tunelab.train.data import batch_tokens, is_packed, label_tokens, lengths_of, loader
from tunelab.train.metrics import mfu, peak_flops, peak_memory_mb
from tunelab.train.parallel.deferred import Deferred
from tunelab.train.parallel.predict import predicted_peak_mb
from tunelab.train.validation import Validation, validation_loss


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    val_loss: float | None
    tokens_per_s: float
    peak_mem_mb: float
    peak_mem_kind: str
    train_seconds: float
    trainable_params: int
    total_params: int
    precision: str
    resumed_from: int | None
    world_size: int = 1
    predicted_peak_mb: float | None = None  # `exp memory`'s prediction for this cell (tensors only)
    peak_mem_mb_ranks: list[float] | None = None  # every process's peak (the same kind), by rank
    validation: dict | None = None  # how val_loss was measured: {batch_size, max_batches}
    # Trained in a together-group (train/members.py): the group, and the peak above is the whole process's
    together: dict | None = None
    continued_in_memory_from: list[int] | None = None  # rungs after which it went on without a restart
    final_val_s: float | None = None  # seconds its final validation took (None: not measured here)
    model: Any = field(default=None, repr=False)  # the trained model with full weights (main process)

    def summary(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "model"}


def lr_lambda(schedule: str, warmup: int, total: int) -> Callable[[int], float]:
    def fn(step: int) -> float:  # step = optimizer steps taken so far
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return {"constant": 1.0, "linear": 1.0 - progress,
                "cosine": 0.5 * (1.0 + math.cos(math.pi * progress))}[schedule]

    return fn


class BatchStream:
    """Micro-batches epoch after epoch, with a position a checkpoint can restore exactly: the state of
    the loader's shuffling generator when the current epoch began, and how many batches it gave since."""

    def __init__(self, dl):
        self.dl, self.epoch, self.taken = dl, 0, 0
        self._begin_epoch(None)

    def _begin_epoch(self, generator_state) -> None:
        g = self.dl.generator
        if g is not None and generator_state is not None:
            g.set_state(generator_state)
        self._epoch_start = g.get_state() if g is not None else None
        self._it = iter(self.dl)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        try:
            batch = next(self._it)
        except StopIteration:
            self.epoch, self.taken = self.epoch + 1, 0
            self._begin_epoch(None)
            batch = next(self._it)
        self.taken += 1
        return batch

    def state(self) -> dict:
        return {"epoch": self.epoch, "taken": self.taken, "generator": self._epoch_start}

    def restore(self, state: dict) -> None:
        self._begin_epoch(state["generator"])
        for _ in range(state["taken"]):  # replays at most one epoch; batches are rebuilt, not trained on
            next(self._it)
        self.epoch, self.taken = state["epoch"], state["taken"]


def _truncate_metrics(path: Path, last_step: int) -> None:
    """A resumed run rewrites the steps after its checkpoint: drop them so no step appears twice."""
    kept = [r for r in read_jsonl(path) if r.get("step", 0) <= last_step]
    write_text(path, "".join(json.dumps(r, default=str) + "\n" for r in kept))


@dataclass
class LoopState:
    """What a checkpoint keeps of the loop besides the data position."""

    tokens_total: int = 0
    seconds: float = 0.0
    loss: float = float("nan")
    val_loss: float | None = None


@dataclass
class Training:
    """One run of the loop, its parts listed: what every step needs (`setup` builds it, `train` runs it)."""

    cfg: CellConfig
    runtime: Runtime
    stepper: parallel.Stepper  # one process or a parallel engine: does each step, saves and loads its state,
    # and holds the optimizer (optim.build, through the engine)
    sched: torch.optim.lr_scheduler.LambdaLR
    stream: BatchStream  # the training micro-batches, with a position a checkpoint restores
    folder: CellFolder  # train/metrics.jsonl, checkpoints/, summary, final/
    emit: Emit
    validate: Callable[[], float] | None  # None: no validation set
    n_params: int
    attention: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext  # around each train step
    model: Any = None  # as the caller built it (the stepper may wrap or shard it)
    tokenizer: Any = None
    validation: Validation = Validation()
    trainable: int = 0  # parameters the optimizer updates, counted before an engine shards them
    longest: int | None = None  # the longest training row (the memory prediction's sequence length)
    state: LoopState = field(default_factory=LoopState)
    # Where this run stops (validated, checkpointed) and where it validates on the way (a search's rungs): neither
    # is the cell's identity.
    stop_at: int | None = None
    validate_at: frozenset[int] = frozenset()
    # Steps saved and kept for the checkpoints' evaluation (checkpoint_scores.steps.StepScores): not the model's
    # identity, since saving changes no number
    retention: checkpoint.Retention = field(default_factory=checkpoint.NoRetention)
    meter: CpuMeter | None = None  # on a CPU: how busy its CPUs were while it trained (machine/load.py)
    # How final/ is written (None: the model's save_pretrained); a member of a together-group writes its own
    # adapter only (train/members.py), and says so in the summary (`together`, `continued_in_memory_from`).
    final_writer: Callable[[Path], None] | None = None
    together: dict | None = None
    continued_in_memory_from: list[int] = field(default_factory=list)
    spent: dict[str, float] = field(default_factory=dict)  # seconds by kind (checkpoint_s), for a run's timings
    validated_at: int | None = None  # the step this run last validated after (state.val_loss is its loss)

    @property
    def metrics_path(self) -> Path:
        return self.folder.metrics_file


def _local_runtime(model: Any, cfg: CellConfig) -> Runtime:
    """A one-process runtime for a model loaded by the caller (library use, tests): its device and dtype."""
    p = next(model.parameters())
    engine = uses_engine(cfg.parallel)
    attn = getattr(model.config, "_attn_implementation", "sdpa")
    return Runtime(Layout(device=p.device), p.dtype, attn, precision_of(cfg, p.device, engine, p.dtype))


def _setup(model: Any, tokenizer: Any, datasets: dict, cfg: CellConfig, folder: CellFolder, emit: Emit,
           runtime: Runtime, validation: Validation, weights: Deferred | None,
           names: Callable[[str], str] | None = None) -> Training:
    t = cfg.train
    n_params = sum(p.numel() for p in model.parameters())  # before an engine shards them
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # One process: torch's fused Adam/AdamW kernel (optim.build); the engines keep their optimizers as they were.
    one_process = not (runtime.layout.distributed or uses_engine(cfg.parallel))
    stepper = parallel.prepare(model, lambda ps: optim.build(ps, cfg.optim, max_grad_norm=t.max_grad_norm,
                                                             fused_kernel=one_process),
                               cfg, runtime.layout, runtime.precision, weights=weights, names=names)
    if one_process and not hasattr(stepper.optimizer, "fused_step"):  # LOMO/AdaLomo's stepper does it itself
        # A tied embedding's gradient built in one buffer, not three weight-sized ones (optimizers/tied.py): on
        # CPU the two extra allocations, each freshly faulted in, cost AdamW about 3% of a SmolLM2-135M step.
        prepare_for_fused(model)
    sched = torch.optim.lr_scheduler.LambdaLR(stepper.optimizer, lr_lambda(t.schedule, t.warmup_steps, t.steps))
    attn = getattr(model.config, "_attn_implementation", "sdpa")
    # Packed rows in one process on CPU: flattened and attended example by example (train/segments.py).
    by_example = one_process and is_packed(datasets["train"]) and segments.usable(model)
    pad = tokenizer.pad_token_id
    stream = BatchStream(loader(datasets["train"], t.batch_size, pad, shuffle=True, seed=t.seed,
                                attn=segments.NAME if by_example else attn, group_by_length=t.group_by_length))
    val_ds = datasets["validation"]
    validate = functools.partial(_validate, stepper, val_ds, pad, validation) if len(val_ds) else None
    if runtime.is_main:
        folder.train_dir.mkdir(parents=True, exist_ok=True)
    attention: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    if by_example:
        attention = functools.partial(segments.attending_by_example, model)
    elif one_process and runtime.precision == "bf16" and cpu_attention.usable(model):
        attention = functools.partial(cpu_attention.attending, model)  # short rows' attention in fp32 on CPU
    return Training(cfg, runtime, stepper, sched, stream, folder, emit, validate, n_params, attention=attention,
                    model=model, tokenizer=tokenizer, validation=validation,
                    trainable=trainable,
                    longest=max(lengths_of(datasets["train"]), default=None))


def _validate(stepper: Any, val_ds: Any, pad: int, validation: Validation) -> float:
    """Validation loss through the stepper, its model in eval mode once for the whole set."""
    with stepper.evaluating():
        return validation_loss(stepper.eval_loss, val_ds, pad, validation.batch_size, validation.max_batches)


def resume(loop: Training) -> tuple[int, int | None]:
    """(first step to run, the step resumed from): from the latest complete checkpoint, when there is one."""
    skipped: list[str] = []
    ckpt = _resume_from(loop, skipped) if loop.cfg.train.resume else None
    if ckpt is None:
        if loop.runtime.is_main:
            loop.metrics_path.unlink(missing_ok=True)
        return 1, None
    saved = checkpoint.load(ckpt, stepper=loop.stepper, sched=loop.sched)
    loop.stream.restore(saved["data"])
    loop.state = LoopState(**saved["loop"])
    checkpoint.set_rng_state(saved["rng"])  # last: nothing may draw from the RNGs after this
    if loop.runtime.is_main:
        _truncate_metrics(loop.metrics_path, saved["step"])
    loop.emit(Resumed(saved["step"], ckpt.name, "; ".join(skipped)))
    return saved["step"] + 1, saved["step"]


def _resume_from(loop: Training, skipped: list[str]) -> Path | None:
    """The latest complete checkpoint (checkpoint.usable: each newer incomplete one named in cell.log, and in
    `skipped` for the Resumed event, and skipped), chosen by the main process and the same on every process."""
    import torch.distributed as dist

    def named(path: Path, why: str) -> None:
        warn(f"checkpoint {path} is incomplete and is not used: {why}")
        skipped.append(f"{path.name}: {why}")

    found: list[Path | None | BaseException] = [None]
    if loop.runtime.is_main:
        try:
            found[0] = checkpoint.usable(loop.folder.checkpoints, named)
        except UserError as e:  # every process raises it, not only the main one
            found[0] = e
    if dist.is_initialized():
        dist.broadcast_object_list(found, src=0)
    if isinstance(found[0], BaseException):
        raise found[0]
    return found[0]


@dataclass
class Backward:
    """A step's backward passes done outside its loop (a together-group in batched mode, train/batched.py): the
    micro-batches it drew, their summed loss, and the seconds the loop counts as its own (its share of the pass)."""

    micro: list[dict]
    loss: torch.Tensor
    seconds: float


def _step(loop: Training, step: int, peak: float | None, done: Backward | None = None) -> None:
    t, st = loop.cfg.train, loop.state
    t0 = time.perf_counter()
    micro = done.micro if done is not None else [next(loop.stream) for _ in range(t.grad_accum)]
    n_items = sum(label_tokens(b) for b in micro)
    tokens = sum(batch_tokens(b) for b in micro)
    lr = loop.sched.get_last_lr()[0]
    with loop.attention():
        loss, norm = (loop.stepper.train_step(micro, n_items, step) if done is None
                      else loop.stepper.finish_step(done.loss, micro, step))
    loop.sched.step()
    dt = time.perf_counter() - t0 + (done.seconds if done is not None else 0.0)
    st.tokens_total, st.seconds, st.loss = st.tokens_total + tokens, st.seconds + dt, loss
    mem, _ = peak_memory_mb(loop.runtime.device)
    record = {"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens": tokens,
              "tokens_per_s": tokens / dt, "step_s": dt, "peak_mem_mb": mem,
              "mfu": mfu(loop.n_params, tokens / dt, peak), **(loop.meter.sample() if loop.meter else {})}
    wanted = step == loop.stop_at or step in loop.validate_at
    if (t.eval_every and step % t.eval_every == 0 or wanted) and loop.validate:
        v0 = time.perf_counter()
        st.val_loss = record["val_loss"] = loop.validate()
        loop.validated_at = step
        record["val_s"] = time.perf_counter() - v0  # where a run's time goes (benchmarks/together.py)
    if loop.runtime.is_main and (step % t.log_every == 0 or step == t.steps or "val_loss" in record):
        append_jsonl(loop.metrics_path, record)
    loop.emit(Step(step, t.steps, loss, record))
    if _saves(loop, step):
        _checkpoint(loop, step)


def _saves(loop: Training, step: int) -> bool:
    t = loop.cfg.train
    return bool(t.save_every and (step % t.save_every == 0 or step == t.steps)) or step in loop.retention.save_at


def _checkpoint(loop: Training, step: int) -> None:
    main, t0 = loop.runtime.is_main, time.perf_counter()
    checkpoint.save(loop.folder.checkpoints, step, stepper=loop.stepper, sched=loop.sched,
                    keep=loop.cfg.train.keep_checkpoints, main=main,
                    loop_state={"data": loop.stream.state(), "loop": asdict(loop.state)},
                    protect=loop.retention.protected() if main else ())
    loop.spent["checkpoint_s"] = loop.spent.get("checkpoint_s", 0.0) + time.perf_counter() - t0


def last_step(loop: Training) -> int:
    """The last step this run trains: train.steps, or its stop_at (a search's rung)."""
    t = loop.cfg.train
    return t.steps if loop.stop_at is None else min(loop.stop_at, t.steps)


def paused_before(loop: Training, start: int) -> int | None:
    """The step a run starting at `start` is paused at already (its checkpoint is at or past its stop_at)."""
    if loop.stop_at is not None and start > loop.stop_at and loop.stop_at < loop.cfg.train.steps:
        return start - 1
    return None


def advance(loop: Training, step: int, peak: float | None, stopping: Callable[[], bool] = lambda: False,
            done: Backward | None = None) -> None:
    """Optimizer step `step` and what follows it: its checkpoint when due; then, when `stopping()` says a stop
    signal came, a checkpoint of this step and Preempted; at stop_at (a search's rung) a checkpoint and Paused.
    The loop runs it step after step (`_steps`); a together-group runs it for each member in turn, each member's
    adapter, head settings and random streams in place (train/members.py); `done`: its backward passes were run
    with the other members' in one (batched mode)."""
    _step(loop, step, peak, done)
    saved = _saves(loop, step)
    if stopping():
        if not saved:
            _checkpoint(loop, step)
        raise Preempted(STOP.signal or "a stop signal to another process", step)
    if step == loop.stop_at and step < loop.cfg.train.steps:
        if not saved:
            _checkpoint(loop, step)
        raise Paused(step)


def checkpoint_now(loop: Training, step: int) -> None:
    """A checkpoint of `step` unless the run wrote one there (a together-group stopping between its rounds)."""
    if not _saves(loop, step):
        _checkpoint(loop, step)


def _steps(loop: Training, start: int, peak: float | None) -> None:
    """The optimizer steps; a stop signal (runtime.catch_stop_signals) ends them at a step boundary, all ranks
    at the same one, after a checkpoint of that step. So does `stop_at` (Paused): the schedule still runs over
    train.steps, so the steps after a pause are those of a run that never paused."""
    paused = paused_before(loop, start)
    if paused is not None:
        raise Paused(paused)
    STOP.armed = True
    try:
        for step in range(start, last_step(loop) + 1):
            advance(loop, step, peak, lambda: stop_agreed(loop.runtime.layout))
    finally:
        STOP.armed = False


def _gather(value: float, layout: Layout) -> list[float]:
    """A per-process number from every process, by rank."""
    if not layout.distributed:
        return [value]
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def setup(model: Any, tokenizer: Any, datasets: dict, cfg: CellConfig, out: CellFolder | Path, emit: Emit = ignore,
          *, runtime: Runtime | None = None, validation: Validation = Validation(), weights: Deferred | None = None,
          retention: checkpoint.Retention | None = None, stop_at: int | None = None,
          validate_at: tuple[int, ...] = (), names: Callable[[str], str] | None = None) -> Training:
    """The loop's parts for a model and its data: the stepper (one process or an engine) with its optimizer, the
    schedule, the batches, validation and checkpointing. Every process of a layout calls it; only the main one
    writes files (into `out`, a cell folder). `weights`: the model is on the meta device and the engine fills each
    process's shards from these (train/parallel/deferred.py). `retention`: more steps to checkpoint, and checkpoints
    to keep (an evaluation of checkpoints). `stop_at`: validate and checkpoint after that step and raise Paused;
    `validate_at`: validate after these steps too (neither changes a loss: validation draws no random number).
    `names`: the trainable parameters' names as checkpoints and the optimizer know them (a together-group's member
    keeps the alone cell's: train/members.py)."""
    collector.settle()  # the model is built: from here on the collector runs as often as Python's defaults make it
    folder = out if isinstance(out, CellFolder) else CellFolder(out)
    runtime = runtime or _local_runtime(model, cfg)
    loop = _setup(model, tokenizer, datasets, cfg, folder, emit, runtime, validation, weights, names)
    loop.stop_at, loop.validate_at = stop_at, frozenset(validate_at)
    loop.retention = retention or loop.retention
    return loop


def train(loop: Training) -> TrainResult:
    """Resume from the latest checkpoint (if any), run the steps, validate, save: the caller has seeded the RNGs
    (the cell does it once)."""
    runtime = loop.runtime
    peak = peak_flops(runtime.device)  # before the RNG states a checkpoint restores (a CPU may measure here)
    start, resumed_from = resume(loop)
    if runtime.device.type == "cpu":  # its CPUs' load beside each step's figures (`exp status` reads them)
        loop.meter = CpuMeter(torch.get_num_threads(), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    loop.model.train()
    _steps(loop, start, peak)
    return finish(loop, resumed_from)


def finish(loop: Training, resumed_from: int | None) -> TrainResult:
    """After the last step: the final validation, the result and its summary, final/ written."""
    t, runtime, st = loop.cfg.train, loop.runtime, loop.state
    val, val_s = None, None
    if loop.validation.final and loop.validate:
        if loop.validated_at == t.steps:  # (eval_every divides train.steps): the same weights and batches give the
            val = st.val_loss  # same loss, so it is not measured twice
        else:
            v0 = time.perf_counter()
            val = loop.validate()
            val_s = time.perf_counter() - v0  # validation, not overhead (benchmarks/together.py counts it so)
    mem, kind = peak_memory_mb(runtime.device)  # before the weights are gathered for saving
    result = TrainResult(
        steps=t.steps, final_loss=st.loss, val_loss=val,
        tokens_per_s=st.tokens_total / st.seconds if st.seconds else 0.0,
        peak_mem_mb=mem, peak_mem_kind=kind, train_seconds=st.seconds, trainable_params=loop.trainable,
        total_params=loop.n_params, precision=runtime.precision, resumed_from=resumed_from,
        world_size=runtime.world_size, peak_mem_mb_ranks=_gather(mem, runtime.layout),
        predicted_peak_mb=predicted_peak_mb(loop.model.config, loop.cfg, str(runtime.dtype).removeprefix("torch."),
                                            seq=loop.longest),
        validation=None if val is None else loop.validation.settings(),
        together=loop.together, continued_in_memory_from=loop.continued_in_memory_from or None, final_val_s=val_s,
        model=loop.stepper.unwrap(),  # every rank takes part in gathering the weights
    )
    if runtime.is_main:
        write_json(loop.folder.summary_file, result.summary())
        if t.save_final:  # built beside final/ and renamed in: a kill leaves the old one or none, never half of one
            def save(new: Path) -> None:
                (loop.final_writer or result.model.save_pretrained)(new)
                loop.tokenizer.save_pretrained(new)

            loop.folder.replace_final(save)
    return result


def run(model: Any, tokenizer: Any, datasets: dict, cfg: CellConfig, out: CellFolder | Path, emit: Emit = ignore,
        **setup_args: Any) -> TrainResult:
    """`setup` then `train`: a model trained on its data in one call (library use, tests)."""
    return train(setup(model, tokenizer, datasets, cfg, out, emit, **setup_args))
