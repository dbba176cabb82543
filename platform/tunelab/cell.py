"""One cell, end to end: `python -m tunelab.cell RUN_DIR`.

Reads RUN_DIR/config.yaml, runs the stages (model, data, PEFT, train, eval, tracking) and writes
its outputs and status. Progress events go to stdout as JSON lines, for whoever launched it;
everything else a library prints is sent to stderr so it cannot corrupt that stream.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import yaml


def _event_stream():
    """Keep the real stdout for events and point fd 1 at stderr for everything else."""
    events = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    listening = True

    def emit(**event) -> None:
        nonlocal listening
        if listening:
            try:
                events.write(json.dumps(event) + "\n")
            except BrokenPipeError:  # the launcher went away: the work (and its files) still count
                listening = False

    return emit


def device_for(name: str):
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def run_cell(run_dir: Path, emit, cfg=None, layout=None) -> None:
    """The stages of one cell, on every process of its layout; only the main process writes files.
    Without cfg and layout: read RUN_DIR/config.yaml and run as one plain process."""
    from transformers import set_seed

    from tunelab import env, evals, models, train
    from tunelab.data.build import build as build_data
    from tunelab.store import read_json, write_json, write_status
    from tunelab.tracking import Tracker
    from tunelab.train import checkpoint, peft

    if cfg is None:
        from tunelab.config import CellConfig
        from tunelab.train import parallel

        cfg = CellConfig.model_validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
        layout = parallel.setup(cfg.parallel)
    main = layout.is_main
    meta = read_json(run_dir / "cell.json") or {}
    timings: dict[str, float] = {}
    tracker = None
    if main:
        write_json(run_dir / "env.json", env.snapshot())
        write_status(run_dir, "running", started_at=time.time(), pid=os.getpid(), timings=timings,
                     world_size=layout.pp * layout.dp * layout.tp)
        tracker = Tracker(cfg, run_dir, group=meta.get("matrix", "adhoc"), name=meta.get("slug", run_dir.name),
                          config=cfg.model_dump(mode="json"),
                          tags=[f"{k}={v}" for k, v in meta.get("varying", {}).items()],
                          resuming=cfg.train.resume and checkpoint.latest(run_dir) is not None)
    try:
        t0 = time.perf_counter()
        emit(stage="load")
        set_seed(cfg.train.seed)  # weights a model may create on load
        device = layout.device if layout.distributed else device_for(cfg.train.device)
        model, tokenizer = models.load(cfg.model, device, **peft.load_kwargs(cfg.peft, device))
        emit(stage="data")
        if not main:  # the main process builds the cache once; the others read it
            _barrier()
        datasets = build_data(cfg.data, tokenizer, models.cache_dir())
        if main:
            _barrier()
        # Again: building data draws from the global RNGs on a cache miss only, and adapter init must not
        # depend on whether the data was cached.
        set_seed(cfg.train.seed)
        model = peft.apply(model, cfg.peft)
        timings["setup_s"] = time.perf_counter() - t0

        def emit_and_log(**event):
            if event.get("stage") == "train" and tracker:
                metrics = event.pop("metrics", {})
                tracker.log({("val/loss" if k == "val_loss" else f"train/{k}"): v for k, v in metrics.items()
                             if k != "step" and v is not None}, step=event["step"])
            emit(**event)

        t0 = time.perf_counter()
        result = train.run(model, tokenizer, datasets, cfg, run_dir, emit_and_log, layout=layout)
        timings["train_s"] = time.perf_counter() - t0

        if main:  # evaluation needs the whole model: one process does it while the others wait
            t0 = time.perf_counter()
            ctx = evals.Context(out_dir=run_dir / "eval", validation=datasets["validation"],
                                val_loss=result.val_loss)
            scores = evals.run(peft.for_eval(result.model), tokenizer, cfg.eval, ctx, emit)
            timings["eval_s"] = time.perf_counter() - t0
            tracker.summary({**{f"train/{k}": v for k, v in result.summary().items()},
                             **{f"eval/{k}": r["value"] for k, r in scores["tasks"].items()
                                if r.get("value") is not None}})
            tracker.finish()
            write_status(run_dir, "done", finished_at=time.time(), timings=timings)
        _barrier()
    except KeyboardInterrupt:
        if main:  # interrupted, not broken: the next `exp run` picks it up (from its last checkpoint)
            tracker.finish(failed=True)
            write_status(run_dir, "pending", finished_at=time.time(), timings=timings, note="interrupted")
        raise
    except BaseException as e:
        if main:
            tracker.finish(failed=True)
            write_status(run_dir, "failed", finished_at=time.time(), timings=timings,
                         error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        raise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tunelab.cell RUN_DIR", file=sys.stderr)
        return 2
    from contextlib import nullcontext

    from tunelab.config import CellConfig
    from tunelab.store import Locked, lock
    from tunelab.train import parallel

    run_dir = Path(argv[0]).resolve()
    emit = _event_stream()
    try:
        cfg = CellConfig.model_validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
        layout = parallel.setup(cfg.parallel)  # joins torchrun's process group for multi-process layouts
        if not layout.is_main:
            emit = _quiet
        with lock(run_dir) if layout.is_main else nullcontext():
            run_cell(run_dir, emit, cfg, layout)
    except Locked:
        print(f"{run_dir} is locked by another process", file=sys.stderr)
        return 3
    except Exception:  # noqa: BLE001 - the traceback goes to cell.log, the exit code says failed
        traceback.print_exc()
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _quiet(**event) -> None:
    """Events come from the main process only."""


if __name__ == "__main__":
    sys.exit(main())
