"""How one cell's training is put together, top to bottom, in one place: `assemble` builds an `Assembly` whose
fields are its parts in the order they are made; `cell.stages` trains it.

    seed            the cell's one seed (train.seed); loading and data building draw on forks of it
    model           models.loading, as the layout builds it (whole, on the meta device, or ZeRO-3 partitioned:
                    train.parallel.init_mode), then its adapters (train.peft) initialised for real
    datasets        data.build: the main process builds the cache, the others read it
    training        train.loop.setup: the stepper (one process or an engine) holding the optimizer
                    (train.optim), the schedule, the batches, validation, checkpointing (and what is kept for
                    the checkpoints' scores: checkpoint_scores.steps)
    evaluators      checkpoint evaluators beside training (checkpoint_scores.cell_side), entered around it
    tracking        the attempt's W&B run (cell.attempt, opened when the cell started)
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from typing import Any

from tunelab.cell.attempt import Attempt
from tunelab.checkpoint_scores import cell_side
from tunelab.checkpoint_scores.steps import StepScores
from tunelab.core import events
from tunelab.core.events import Stage


@dataclass
class Assembly:
    """One attempt's training, its parts in the order `assemble` makes them."""

    attempt: Attempt  # folder, config, runtime, events and the W&B run (tracking)
    model: Any  # the base with its adapters
    tokenizer: Any
    datasets: dict  # train / validation
    training: Any  # train.loop.Training: stepper + optimizer, schedule, batches, validation, checkpointing
    evaluators: contextlib.AbstractContextManager  # checkpoint evaluators beside training
    rss_before_mb: float  # what the process held before the model (`exp memory` predicts what training adds)


def assemble(attempt: Attempt) -> Assembly:
    """Load, build data, put the adapters on and set up the loop, on every process of the layout."""
    import torch
    from transformers import set_seed

    from tunelab.data import build  # noqa: F401 - imported before the baseline below: libraries are not training
    from tunelab.train import loop, parallel, peft
    from tunelab.train.validation import Validation

    cfg, rt, t0 = attempt.cfg, attempt.rt, time.perf_counter()
    rss_before = rss_mb()
    attempt.emit(Stage("load"))
    # The one seed of a cell. Loading and data building run on forks of it: what a layout's way of building
    # the model draws, or a data cache miss (a hit draws nothing), leaves the adapters' init and the training's
    # draws the same on every layout and every run.
    set_seed(cfg.train.seed)
    with torch.random.fork_rng(devices=[]):
        model, tokenizer, files = load_model(attempt)
        t1 = time.perf_counter()
        datasets = build_data(attempt, tokenizer)
        attempt.timings.update(load_s=t1 - t0, data_s=time.perf_counter() - t1)
    weights = None
    if files is None:
        model = peft.apply(model, cfg.peft)
    else:  # adapters initialised for real, the base weights read per shard by the engine
        model, weights = parallel.with_adapters(model, lambda m: peft.apply(m, cfg.peft), files)
    training = loop.setup(model, tokenizer, datasets, cfg, attempt.folder, attempt.emit, runtime=rt,
                          validation=Validation.of(cfg.eval), weights=weights,
                          retention=StepScores(attempt.folder, cfg), stop_at=attempt.stop_at,
                          validate_at=attempt.validate_at)
    attempt.timings["setup_s"] = time.perf_counter() - t0
    return Assembly(attempt, model, tokenizer, datasets, training,
                    evaluators=cell_side.evaluators(attempt.folder, cfg, rt), rss_before_mb=rss_before)


def load_model(attempt: Attempt) -> tuple[Any, Any, Any]:
    """The model as the layout builds it (train.parallel.init_mode) and the tokenizer -> (model, tokenizer,
    checkpoint files when the model is on the meta device). The model is built from the same files either way."""
    from tunelab.models import loading
    from tunelab.train import parallel, peft

    cfg, rt = attempt.cfg, attempt.rt
    safetensors = rt.layout.distributed and any(loading.folder(cfg.model).glob("*.safetensors"))
    mode, why = parallel.init_mode(cfg, rt.layout, safetensors)
    if rt.layout.distributed:
        print(f"model init: {mode} ({why})", file=sys.stderr)
    if mode == "meta":
        return loading.empty(cfg.model, rt.dtype, rt.attn), loading.tokenizer(cfg.model), \
            loading.Weights(loading.folder(cfg.model))
    if mode == "zero3":
        return parallel.load_partitioned(cfg.model, rt, cfg), loading.tokenizer(cfg.model), None
    return (*loading.load(cfg.model, rt, **peft.load_kwargs(cfg.peft, rt.device)), None)


def build_data(attempt: Attempt, tokenizer: Any) -> dict:
    """The cell's datasets: the main process builds the cache once, the others read it."""
    from tunelab.core.paths import cache_dir
    from tunelab.data.build import build as build_data

    attempt.emit(Stage("data"))
    if not attempt.rt.is_main:
        barrier()
    datasets = build_data(attempt.cfg.data, tokenizer, cache_dir(),
                          progress=lambda done, total: attempt.emit(events.DataProgress(done, total)))
    if attempt.rt.is_main:
        barrier()
    return datasets


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def rss_mb() -> float:
    """This process's resident memory now (the baseline its load and training add to)."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20
