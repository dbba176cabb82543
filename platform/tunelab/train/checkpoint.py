"""Checkpoints under a cell folder's checkpoints/step-N/ (`root` below: CellFolder.checkpoints): everything a
run needs to continue bit for bit.

  model.pt        one process: the trainable parameters (full model, or the adapter); frozen ones come
  optimizer.pt    from the source; the optimizer's state_dict, when it has one (train/parallel/local.py)
  engine/         a parallel engine: every process's shards of model and optimizer (torch distributed
                  checkpoint, or DeepSpeed's format)
  state.pt        scheduler, RNG states (python, numpy, torch, cuda), data position, loop counters
  manifest.json   written last: every file above with its size and SHA-256

The stepper writes its part, the main process the rest. A checkpoint is written into a temporary folder and
renamed once complete, so a run killed while saving leaves the previous checkpoint as the latest one. A
checkpoint is complete or it is not used: its manifest lists every file it holds, and a resume checks each one
(there, the same size, the same hash) before it reads any (`usable`); one that fails (a file deleted, cut short or
changed since, or no manifest at all) is named and skipped for the previous complete one. A failed write (a full
disk, `ulimit -f`) removes the temporary folder and says which limit it met (core.files.WriteFailed). Only the
latest `train.keep_checkpoints` are kept, and those the caller protects (checkpoints waiting for their evaluation,
the best ones of a selection: tunelab.checkpoint_scores.steps). `load_weights` reads a checkpoint's model weights into a
one-process model, whichever layout wrote it (checkpoint evaluation, train.select).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from tunelab.core.errors import UserError
from tunelab.core.files import WriteFailed, write_failure, write_json
from tunelab.folders.cell import step_dirs, step_name

STATE, MANIFEST = "state.pt", "manifest.json"


def is_checkpoint(path: Path) -> bool:
    """Whether `path` is a checkpoint folder this module wrote (its loop state is in it)."""
    return path.is_dir() and (path / STATE).is_file()


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(folder: Path, step: int) -> None:
    """The checkpoint's last file: every other file in it, with its size and SHA-256 (the engines' shards of every
    rank included: the main process writes it after they all wrote theirs)."""
    files = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}
    write_json(folder / MANIFEST, {"step": step, "files": files})


def incomplete(folder: Path) -> str | None:
    """Why the checkpoint in `folder` must not be used (a file missing, cut short or changed since its manifest
    was written, or no manifest), or None when every file its manifest lists is there as it was written."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
        listed = {str(k): (int(v["size"]), str(v["sha256"])) for k, v in files.items()}
    except FileNotFoundError:
        return f"it has no {MANIFEST} (its save never finished, or a tunelab before manifests wrote it)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its {MANIFEST} is unreadable ({type(e).__name__}: {e})"
    if STATE not in listed:
        return f"its {MANIFEST} does not list {STATE}"
    for rel, (size, digest) in listed.items():
        path = folder / rel
        try:
            got = path.stat().st_size
            if got != size:
                return f"{rel} has {got} bytes where its manifest says {size} (cut short or changed since)"
            if _sha256(path) != digest:
                return f"{rel} is not the file that was written (its SHA-256 differs from the manifest's)"
        except FileNotFoundError:
            return f"{rel} is missing"
        except OSError as e:
            return f"{rel} is unreadable ({e.strerror or e})"
    return None


def usable(root: Path, skip: Callable[[Path, str], None]) -> Path | None:
    """The latest complete checkpoint under `root`; each newer one that is not complete is handed to `skip` with
    why, and passed over. None when there is none at all; UserError when there are checkpoints but none is
    complete: training from the start would silently drop what they hold."""
    steps = all_steps(root)
    skipped = []
    for _, path in reversed(steps):
        why = incomplete(path)
        if why is None:
            return path
        skip(path, why)
        skipped.append(f"{path} ({why})")
    if skipped:
        raise UserError(f"no complete checkpoint to resume from: {'; '.join(skipped)}. Delete the checkpoints/ "
                        "folder to train from the start", file=root)
    return None


def all_steps(root: Path) -> list[tuple[int, Path]]:
    return step_dirs(root)


def latest(root: Path) -> Path | None:
    steps = all_steps(root)
    return steps[-1][1] if steps else None


class Retention(Protocol):
    """What else the loop saves and keeps besides train.save_every and keep_checkpoints
    (checkpoint_scores.steps.StepScores: the checkpoints an evaluation asks for, kept until scored, and a selection's
    best)."""

    @property
    def save_at(self) -> frozenset[int]: ...

    def protected(self) -> Collection[int]: ...


@dataclass(frozen=True)
class NoRetention:
    save_at: frozenset[int] = frozenset()

    def protected(self) -> Collection[int]:
        return ()


def prune(root: Path, keep: int, protect: Collection[int] = ()) -> None:
    """Delete every checkpoint but the latest `keep` and the `protect`ed steps."""
    for step, old in all_steps(root)[:-keep]:
        if step not in protect:
            shutil.rmtree(old, ignore_errors=True)


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


def save(root: Path, step: int, *, stepper, sched, loop_state: dict, keep: int, main: bool = True,
         protect: Collection[int] = ()) -> Path:
    """Every process calls it (engines write shards from each rank); the main one renames and prunes (sparing
    the `protect`ed steps)."""
    import torch.distributed as dist

    tmp, dest = root / f".{step_name(step)}-partial", root / step_name(step)
    barrier = dist.barrier if dist.is_initialized() else (lambda: None)
    try:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        target = tmp / stepper.checkpoint_subdir
        if main:
            target.mkdir(parents=True, exist_ok=True)
        stepper.save(target)
        barrier()
        if main:
            torch.save({"step": step, "scheduler": sched.state_dict(), "rng": rng_state(), **loop_state},
                       tmp / STATE)
            write_manifest(tmp, step)  # last: a checkpoint without it is not used
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(tmp, dest)
            prune(root, keep, protect)
    except (OSError, RuntimeError) as e:  # a full disk, `ulimit -f`, a read-only folder: torch says "write failed"
        cause = write_failure(e, tmp)
        if main:
            shutil.rmtree(tmp, ignore_errors=True)  # what it held is no checkpoint, and it took space
        if cause is None:
            raise
        raise WriteFailed(f"cannot write the checkpoint of step {step}: {cause}; the checkpoints before it are "
                          "kept. Free space (or raise the limit), then run again: the cell resumes from its last "
                          "complete checkpoint", file=dest, cause=cause) from e
    barrier()
    return dest


def load(path: Path, *, stepper, sched) -> dict:
    """Restore the stepper's model and optimizer and the scheduler in place; returns the loop state (step,
    data position ...). RNG states are returned, not set: the caller sets them last, once nothing else will
    draw from them."""
    try:
        stepper.load(path / stepper.checkpoint_subdir)
        # Our own file: RNG states hold numpy arrays and tuples, which weights_only refuses.
        state = torch.load(path / STATE, map_location="cpu", weights_only=False)
    except (OSError, EOFError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError) as e:
        # Written whole or not at all (renamed once complete): damage came later (disk, copy, a hand).
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise UserError(f"checkpoint unreadable ({type(e).__name__}: {first}); delete this folder to resume from "
                        "an earlier checkpoint, or the whole checkpoints/ folder to train from the start",
                        file=path) from e
    sched.load_state_dict(state.pop("scheduler"))
    return state


def copy_trainable(model: Any, saved: dict[str, torch.Tensor], where: Path) -> None:
    """A one-process checkpoint's model.pt (the trainable parameters) into `model`, which must have exactly those
    trainable parameters."""
    params = dict(model.named_parameters())
    expected = {n for n, p in params.items() if p.requires_grad}
    if set(saved) != expected:
        missing, extra = sorted(expected - set(saved))[:5], sorted(set(saved) - expected)[:5]
        raise RuntimeError(f"checkpoint {where} does not match the model (missing {missing}, unexpected "
                           f"{extra}); delete the checkpoints folder to start over")
    with torch.no_grad():
        for name, tensor in saved.items():
            params[name].copy_(tensor)


def load_weights(model: Any, path: Path) -> None:
    """The model weights of checkpoint `path` (checkpoints/step-N/) into a one-process model built as the cell
    builds it (base model + PEFT): the trainable parameters of a one-process checkpoint (model.pt), or the
    model part of an engine's torch distributed checkpoint (engine/, any native layout; read by this process
    alone, also inside a process group). The optimizer's state is not read."""
    engine = path / "engine"
    try:
        if (engine / ".metadata").is_file():
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

            state = {"train": {"model": get_model_state_dict(model)}}
            dcp.load(state, checkpoint_id=str(engine), no_dist=True)
            set_model_state_dict(model, state["train"]["model"])
        elif (path / "model.pt").is_file():
            copy_trainable(model, torch.load(path / "model.pt", map_location="cpu", weights_only=True), path)
        else:
            raise UserError("no model weights one process can read here (model.pt, or engine/ written by the "
                            "native engine)", file=path)
    except (OSError, EOFError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise UserError(f"checkpoint weights unreadable ({type(e).__name__}: {first})", file=path) from e
