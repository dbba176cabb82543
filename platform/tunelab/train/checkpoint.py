"""Checkpoints under a cell folder's checkpoints/step-N/ (`root` below: CellFolder.checkpoints): everything a
run needs to continue bit for bit.

  model.pt        one process: the trainable parameters (full model, or the adapter); frozen ones come
  optimizer.pt    from the source; the optimizer's state_dict, when it has one (train/parallel/local.py)
  engine/         a parallel engine: every process's shards of model and optimizer (torch distributed
                  checkpoint, or DeepSpeed's format)
  state.pt        scheduler, RNG states (python, numpy, torch, cuda), data position, loop counters

The stepper writes its part, the main process the rest. A checkpoint is written into a temporary folder and
renamed once complete, so a run killed while saving leaves the previous checkpoint as the latest one.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from tunelab.errors import UserError

STEP_DIR = re.compile(r"^step-(\d+)$")


def all_steps(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = ((STEP_DIR.match(p.name), p) for p in root.iterdir() if p.is_dir())
    return sorted((int(m.group(1)), p) for m, p in found if m)


def latest(root: Path) -> Path | None:
    steps = all_steps(root)
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


def save(root: Path, step: int, *, stepper, sched, loop_state: dict, keep: int, main: bool = True) -> Path:
    """Every process calls it (engines write shards from each rank); the main one renames and prunes."""
    import torch.distributed as dist

    tmp, dest = root / f".step-{step}-partial", root / f"step-{step}"
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier = dist.barrier if dist.is_initialized() else (lambda: None)
    barrier()
    target = tmp / stepper.checkpoint_subdir
    if main:
        target.mkdir(parents=True, exist_ok=True)
    stepper.save(target)
    barrier()
    if main:
        torch.save({"step": step, "scheduler": sched.state_dict(), "rng": rng_state(), **loop_state},
                   tmp / "state.pt")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
        for _, old in all_steps(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return dest


def load(path: Path, *, stepper, sched) -> dict:
    """Restore the stepper's model and optimizer and the scheduler in place; returns the loop state (step,
    data position ...). RNG states are returned, not set: the caller sets them last, once nothing else will
    draw from them."""
    try:
        stepper.load(path / stepper.checkpoint_subdir)
        # Our own file: RNG states hold numpy arrays and tuples, which weights_only refuses.
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    except (OSError, EOFError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError) as e:
        # Written whole or not at all (renamed once complete): damage came later (disk, copy, a hand).
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise UserError(f"checkpoint unreadable ({type(e).__name__}: {first}); delete this folder to resume from "
                        "an earlier checkpoint, or the whole checkpoints/ folder to train from the start",
                        file=path) from e
    sched.load_state_dict(state.pop("scheduler"))
    return state
