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

    def emit(**event) -> None:
        events.write(json.dumps(event) + "\n")

    return emit


def device_for(name: str):
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def run_cell(run_dir: Path, emit) -> None:
    from tunelab import env, evals, models, train
    from tunelab.data.build import build as build_data
    from tunelab.config import CellConfig
    from tunelab.store import read_json, write_json, write_status
    from tunelab.tracking import Tracker
    from tunelab.train import peft

    cfg = CellConfig.model_validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
    meta = read_json(run_dir / "cell.json") or {}
    write_json(run_dir / "env.json", env.snapshot())
    timings: dict[str, float] = {}
    write_status(run_dir, "running", started_at=time.time(), pid=os.getpid(), timings=timings)
    tracker = Tracker(cfg, run_dir, group=meta.get("matrix", "adhoc"), name=meta.get("slug", run_dir.name),
                      config=cfg.model_dump(mode="json"), tags=[f"{k}={v}" for k, v in meta.get("varying", {}).items()])
    try:
        t0 = time.perf_counter()
        emit(stage="load")
        model, tokenizer = models.load(cfg.model, device_for(cfg.train.device))
        emit(stage="data")
        datasets = build_data(cfg.data, tokenizer, models.cache_dir())
        model = peft.apply(model, cfg.peft)
        timings["setup_s"] = time.perf_counter() - t0

        def emit_and_log(**event):
            emit(**event)
            if event.get("stage") == "train":
                tracker.log({"train/loss": event["loss"]}, step=event["step"])

        t0 = time.perf_counter()
        result = train.run(model, tokenizer, datasets, cfg, run_dir, emit_and_log)
        timings["train_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        ctx = evals.Context(out_dir=run_dir / "eval", validation=datasets["validation"],
                                val_loss=result.val_loss)
        scores = evals.run(peft.for_eval(model), tokenizer, cfg.eval, ctx, emit)
        timings["eval_s"] = time.perf_counter() - t0

        tracker.summary({**{f"train/{k}": v for k, v in result.__dict__.items()},
                         **{f"eval/{k}": r["value"] for k, r in scores["tasks"].items()}})
        tracker.finish()
        write_status(run_dir, "done", finished_at=time.time(), timings=timings)
    except BaseException as e:
        tracker.finish(failed=True)
        write_status(run_dir, "failed", finished_at=time.time(), timings=timings,
                     error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        raise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tunelab.cell RUN_DIR", file=sys.stderr)
        return 2
    from tunelab.store import Locked, lock

    run_dir = Path(argv[0]).resolve()
    emit = _event_stream()
    try:
        with lock(run_dir):
            run_cell(run_dir, emit)
    except Locked:
        print(f"{run_dir} is locked by another process", file=sys.stderr)
        return 3
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
