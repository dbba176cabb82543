"""Checkpoints under RUN_DIR/checkpoints/step-N/: everything a run needs to continue bit for bit.

  model.pt        the trainable parameters (full model, or the adapter); frozen ones come from the source
  optimizer.pt    the optimizer's state_dict, when it has one
  state.pt        scheduler, RNG states (python, numpy, torch, cuda), data position, loop counters

A checkpoint is written into a temporary folder and renamed, so a run killed while saving leaves the
previous checkpoint as the latest one.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

STEP_DIR = re.compile(r"^step-(\d+)$")


def folder(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def all_steps(run_dir: Path) -> list[tuple[int, Path]]:
    root = folder(run_dir)
    if not root.is_dir():
        return []
    found = ((STEP_DIR.match(p.name), p) for p in root.iterdir() if p.is_dir())
    return sorted((int(m.group(1)), p) for m, p in found if m)


def latest(run_dir: Path) -> Path | None:
    steps = all_steps(run_dir)
    return steps[-1][1] if steps else None


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}


def save(run_dir: Path, step: int, *, model, opt, sched, loop_state: dict, keep: int) -> Path:
    root = folder(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".step-{step}-"))
    try:
        torch.save(trainable_state(model), tmp / "model.pt")
        # Optimizers without a state_dict (some in-backward ones) have nothing more to save.
        if callable(getattr(opt, "state_dict", None)):
            torch.save(opt.state_dict(), tmp / "optimizer.pt")
        torch.save({"step": step, "scheduler": sched.state_dict(), "rng": rng_state(), **loop_state},
                   tmp / "state.pt")
        dest = root / f"step-{step}"
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for _, old in all_steps(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return dest


def save_engine(run_dir: Path, step: int, *, stepper, sched, loop_state: dict, keep: int, main: bool) -> Path:
    """The same checkpoint from a parallel engine: every process writes its shards of model and optimizer
    (torch distributed checkpoint, or DeepSpeed's format) under engine/, the main one the loop state.
    Written beside the final name and renamed by the main process once all shards are in."""
    import torch.distributed as dist

    root = folder(run_dir)
    tmp, dest = root / f".step-{step}-partial", root / f"step-{step}"
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier = dist.barrier if dist.is_initialized() else (lambda: None)
    barrier()
    stepper.save(tmp / "engine")
    barrier()
    if main:
        torch.save({"step": step, "scheduler": sched.state_dict(), "rng": rng_state(), **loop_state},
                   tmp / "state.pt")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
        for _, old in all_steps(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return dest


def load(path: Path, *, model, opt, sched) -> dict:
    """Restore model, optimizer and scheduler in place; returns the loop state (step, data position ...).
    With model=None (a parallel engine restores its own shards) only the loop state is read.

    RNG states are returned, not set: the caller sets them last, once nothing else will draw from them.
    """
    if model is None:
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
        sched.load_state_dict(state.pop("scheduler"))
        return state
    saved = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
    params = dict(model.named_parameters())
    expected = {n for n, p in params.items() if p.requires_grad}
    if set(saved) != expected:
        missing, extra = sorted(expected - set(saved))[:5], sorted(set(saved) - expected)[:5]
        raise RuntimeError(f"checkpoint {path} does not match the model (missing {missing}, unexpected {extra}); "
                           "delete the checkpoints folder to start over")
    with torch.no_grad():
        for name, tensor in saved.items():
            params[name].copy_(tensor)
    if (path / "optimizer.pt").is_file() and callable(getattr(opt, "load_state_dict", None)):
        opt.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
    # Our own file: RNG states hold numpy arrays and tuples, which weights_only refuses.
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    sched.load_state_dict(state.pop("scheduler"))
    return state
