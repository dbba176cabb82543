"""One cell's folder: the only code that knows its layout. Runner, cell process, status, report, export,
chat and clean all read and write it through `CellFolder`.

    runs/<matrix>/<slug>-<id>/       id = CellConfig.id(): a hash of the training config only
      config.yaml cell.json status.json env.json cell.log .lock
      attempts.jsonl                 one line per run of the cell that ended: how long it held how many devices,
                                     where its time went (timings), the together-group it ran in
      train/metrics.jsonl train/summary.json train/memory.json
      final/                         the trained model (or adapter)
      checkpoints/step-N/            what a resume needs (train/checkpoint.py writes inside)
      eval/<eval-id>/results.json    eval-id = EvalCfg.id(): each evaluation config names its results
      eval/<eval-id>/samples.jsonl
      eval/<eval-id>/step-N/         a checkpoint's evaluation (eval.checkpoints; eval-id: its settings' id),
                                     results.json and samples.jsonl, the folder renamed into place once complete
      train/selection.json           which checkpoint final/ holds (train.select)

So adding a task to a finished matrix evaluates the saved final/ weights again and trains nothing. Folders
of the first layout (the id hashed the eval section too, eval/results.json) are migrated on first touch
(`migrate`). A status "running" under a free lock belongs to a process that died (`live_state`).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tunelab.core.config import CellConfig
from tunelab.core.errors import UserError
from tunelab.core.files import append_jsonl, read_json, read_jsonl, write_json, write_yaml
from tunelab.core.locks import CellLock, is_locked, lock_holder

LAYOUT = 2  # cell.json "layout"; absent in folders of the first layout
STATES = ("pending", "running", "done", "failed")
# What status.json says of one attempt: its failure, or the note of how it stopped ("interrupted", requeued).
# write_failed: the limit a failed write met (disk full, quota, read-only, ulimit -f), retried by a plain `exp run`.
ATTEMPT_FIELDS = ("error", "traceback", "exit", "log_tail", "bad_input", "note", "write_failed", "group_died")
LOG_TAIL_LINES = 20  # of cell.log, kept in status.json when a cell fails
# What to do about a damaged state file (core.files.read_json says what is wrong with it, and this).
RERUN = ("delete it: the next `exp run` of its matrix writes it again (the cell resumes from its last complete "
         "checkpoint)")
REWRITTEN = "delete it: the next `exp run` of its matrix that runs this cell writes it again"
STEP_DIR = re.compile(r"^step-(\d+)$")  # checkpoints/step-N/ and eval/<eval-id>/step-N/


def step_name(step: int) -> str:
    """The folder of step N in checkpoints/ and eval/<eval-id>/: step-N."""
    return f"step-{step}"


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step-N folder under `root`, by step (none when root is missing)."""
    if not root.is_dir():
        return []
    found = ((STEP_DIR.match(p.name), p) for p in root.iterdir() if p.is_dir())
    return sorted((int(m.group(1)), p) for m, p in found if m)


class At:
    """A path inside a folder object (anything with `.path`), read as an attribute: `final = At("final")`."""

    def __init__(self, *parts: str):
        self.parts = parts

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else obj.path.joinpath(*self.parts)  # on the class: the At itself

    @property
    def name(self) -> str:
        return self.parts[-1]


@dataclass(frozen=True)
class EvalFolder:
    """One evaluation's output folder: a cell's eval/<eval-id>/, a checkpoint's eval/<eval-id>/step-N/, or
    `exp eval run --out`. The evaluation layer is handed one and writes only these files."""

    path: Path

    results_file = At("results.json")  # written last: complete results mark a finished evaluation
    samples_file = At("samples.jsonl")
    log_file = At("eval.log")  # `exp eval run`: what the libraries print (bars, warnings), not the terminal


OWN_TIMINGS = ("setup_s", "train_s", "eval_s", "checkpoints_s")  # a together-group member's own parts of its run


@dataclass(frozen=True)
class CellFolder:
    path: Path

    # -- the layout ---------------------------------------------------------------------------------------
    config_file = At("config.yaml")
    meta_file = At("cell.json")
    status_file = At("status.json")
    env_file = At("env.json")
    log_file = At("cell.log")
    attempts_file = At("attempts.jsonl")
    train_dir = At("train")
    metrics_file = At("train", "metrics.jsonl")
    summary_file = At("train", "summary.json")
    memory_file = At("train", "memory.json")
    selection_file = At("train", "selection.json")
    final = At("final")
    checkpoints = At("checkpoints")
    eval_root = At("eval")
    slurm_script = At("slurm.sbatch")  # the cell's own SLURM job (run/slurm.py)

    def eval_dir(self, eval_id: str) -> Path:
        return self.eval_root / eval_id

    def results_file(self, eval_id: str) -> Path:
        return EvalFolder(self.eval_dir(eval_id)).results_file

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints / step_name(step)

    def checkpoint_steps(self) -> list[int]:
        """The steps whose checkpoints are in checkpoints/ (complete ones: each is renamed into place)."""
        return [s for s, _ in step_dirs(self.checkpoints)]

    def step_dir(self, eval_id: str, step: int) -> Path:
        """A checkpoint's evaluation: eval/<eval-id>/step-N/ (it exists once complete)."""
        return self.eval_dir(eval_id) / step_name(step)

    def step_results(self, eval_id: str, step: int) -> dict[str, Any]:
        return read_json(EvalFolder(self.step_dir(eval_id, step)).results_file, dict) or {}

    def step_claim(self, eval_id: str, step: int) -> CellLock:
        """The lock an evaluator holds while it scores one checkpoint (eval/<eval-id>/.step-N.lock)."""
        return CellLock(self.eval_dir(eval_id), f".{step_name(step)}.lock")

    def step_evaluations(self, eval_id: str) -> dict[int, dict[str, Any]]:
        """Every checkpoint evaluation of `eval_id` written so far: step -> results.json."""
        found = ((s, read_json(EvalFolder(d).results_file, dict)) for s, d in step_dirs(self.eval_dir(eval_id)))
        return {s: res for s, res in found if res is not None}

    def selection(self) -> dict[str, Any]:
        """train/selection.json: the step final/ holds and why (train.select); {} without a selection."""
        return read_json(self.selection_file, dict, "restore it from a copy, or delete the cell's final/ and "
                         "this file: `exp run` then trains the cell again from its last complete checkpoint") or {}

    # -- reading -----------------------------------------------------------------------------------------
    def exists(self) -> bool:
        """A cell folder has both its config and its cell.json (an aside folder of `exp clean` has neither)."""
        return self.config_file.is_file() and self.meta_file.is_file()

    def meta(self) -> dict[str, Any]:
        """cell.json: matrix, id, slug, varying keys, layout."""
        return read_json(self.meta_file, dict, RERUN) or {}

    def raw_config(self) -> dict[str, Any]:
        """config.yaml as the runner wrote it (every key resolved), not validated: validation resolves the
        recipe and the model name, and a finished cell stays readable when its recipe file has moved."""
        try:
            return yaml.safe_load(self.config_file.read_text()) or {}
        except (OSError, yaml.YAMLError):
            return {}

    def config(self) -> CellConfig:
        """The config the cell runs with (it passed every plan-time check when the runner wrote it)."""
        return CellConfig.model_validate(yaml.safe_load(self.config_file.read_text()))

    def status(self) -> dict[str, Any]:
        return read_json(self.status_file, dict, RERUN) or {}

    def state(self) -> str:
        """The status's state; "running" under a free lock is "interrupted": the process that wrote it died
        without a word (killed, out of memory, machine lost); so is "pending" with a note saying so (stopped by
        Ctrl-C, or killed while its runner watched); the next `exp run` resumes it."""
        status = self.status()
        state = status.get("state", "?")
        if state == "pending" and str(status.get("note") or "").startswith("interrupted"):
            return "interrupted"
        return "interrupted" if state == "running" and not self.is_locked() else state

    def is_trained(self) -> bool:
        """The training part is done and its final weights can be evaluated again."""
        return bool(self.status().get("trained")) and self.final.is_dir()

    def eval_done(self, eval_id: str) -> bool:
        return bool(self.results(eval_id).get("complete"))

    def evaluations(self) -> list[tuple[str, dict]]:
        """Every evaluation, newest first: (eval id, results.json); a first-layout eval/results.json has the
        id "eval"."""
        name = EvalFolder.results_file.name
        found = [(p, p.parent.name) for p in self.eval_root.glob(f"*/{name}")]
        found += [(p, "eval") for p in [EvalFolder(self.eval_root).results_file] if p.is_file()]
        found.sort(key=lambda f: f[0].stat().st_mtime, reverse=True)
        return [(eval_id, res) for p, eval_id in found if (res := read_json(p, dict)) is not None]

    def results(self, eval_id: str | None = None) -> dict[str, Any]:
        """An evaluation's results.json: the one named, else the newest."""
        if eval_id is not None:
            return read_json(self.results_file(eval_id), dict) or {}  # damaged: evaluated again
        return next((res for _, res in self.evaluations()), {})

    def samples_file(self, eval_id: str | None = None) -> Path | None:
        """samples.jsonl of the evaluation named, else of the newest that has one."""
        if eval_id is not None and EvalFolder(self.eval_dir(eval_id)).samples_file.is_file():
            return EvalFolder(self.eval_dir(eval_id)).samples_file
        found = [(p.stat().st_mtime, p) for p in self.eval_root.glob(f"*/{EvalFolder.samples_file.name}")]
        old = EvalFolder(self.eval_root).samples_file
        return max(found)[1] if found else (old if old.is_file() else None)

    def summary(self) -> dict[str, Any]:
        return read_json(self.summary_file, dict, REWRITTEN) or {}

    def metrics(self) -> list[dict]:
        return read_jsonl(self.metrics_file)

    def env(self) -> dict[str, Any]:
        return read_json(self.env_file, dict, REWRITTEN) or {}

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> list[str]:
        """The last lines of cell.log (its last 64 KiB at most), each cut at 400 characters."""
        try:
            with self.log_file.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
                text = f.read().decode(errors="replace")
        except OSError:
            return []
        return [line[:400] for line in text.splitlines() if line.strip()][-lines:]

    def disk_usage(self, sub: Path | None = None) -> int:
        """Bytes in the files under the folder (or `sub` of it); apparent sizes, links not followed."""
        total = 0
        for root, _dirs, files in os.walk(sub or self.path):
            for name in files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_size
                except FileNotFoundError:  # a file removed while we walk (a checkpoint being rotated)
                    pass
        return total

    # -- locking -----------------------------------------------------------------------------------------
    def lock(self) -> CellLock:
        return CellLock(self.path)

    def is_locked(self) -> bool:
        return is_locked(self.path)

    def lock_holder(self) -> str:
        return lock_holder(self.path)

    # -- writing (under the folder's lock) ---------------------------------------------------------------
    def prepare(self, config: CellConfig, meta: dict[str, Any]) -> None:
        """A cell about to run: its resolved config, who it is, and status pending."""
        write_yaml(self.config_file, config.model_dump(mode="json"))
        write_json(self.meta_file, {**meta, "layout": LAYOUT})
        self.write_status("pending", created_at=time.time())

    def write_status(self, state: str, **fields: Any) -> dict[str, Any]:
        """Merge into status.json, keeping earlier fields (timings) unless overwritten."""
        if state not in STATES:
            raise ValueError(f"state {state!r} is none of {STATES}")
        before = self.status()
        status = {**before, **fields, "state": state, "updated_at": time.time()}
        if state == "running" or (state == "pending" and "note" not in fields):
            for key in ATTEMPT_FIELDS:  # a new attempt: the last one's failure or stop no longer describes it
                status.pop(key, None)
        write_json(self.status_file, status)
        if before.get("state") == "running" and "finished_at" in fields and "started_at" in before:
            try:
                self._attempt_ended(status)
            except OSError:  # a full disk: the status said what matters; this run's cost goes uncounted
                pass
        return status

    def _attempt_ended(self, status: dict[str, Any]) -> None:
        """A run of the cell ended (done, paused at a rung, stopped or failed): what it cost, measured by the cell
        from its start to its end, appended to attempts.jsonl (status.json keeps only the last run). A run killed
        with its runner (kill -9) ends without a word, and one whose end could not be written (a full disk) is not
        recorded either: nothing counts their time (report/cost.py)."""
        wall = float(status["finished_at"]) - float(status["started_at"])
        group = status.get("together")
        timings = status.get("timings") or {}
        # A together-group's member shares its process with the others: its whole run overlaps theirs, so what
        # it cost is its own part (its setup, its turns of training, its share of the evaluation), the group's
        # shared start-up and load left out (the group's record.json has them).
        seconds = sum(float(timings.get(k) or 0.0) for k in OWN_TIMINGS) if isinstance(group, dict) else wall
        append_jsonl(self.attempts_file, {
            "started_at": status["started_at"], "ended_at": status["finished_at"], "seconds": round(seconds, 3),
            "wall_s": round(wall, 3),
            "state": status["state"], "devices": int(status.get("world_size") or 1),
            "device": status.get("device", "cpu"), "evaluating_only": bool(status.get("evaluating_only")),
            "paused_at": status.get("paused_at"), "pid": status.get("pid"),
            "process_started_at": status.get("process_started_at"),  # its imports and start-up came before
            "together": group.get("group") if isinstance(group, dict) else None,  # a together-group's member
            "timings": status.get("timings") or {}})  # where its time went (a member: its own turns)

    def attempts(self) -> list[dict[str, Any]]:
        """Every ended run of the cell (attempts.jsonl): seconds, devices, whether it only evaluated."""
        return read_jsonl(self.attempts_file)

    def replace_final(self, write: Callable[[Path], None]) -> None:
        """final/ replaced by what `write` puts into a fresh folder (the trained model, or the checkpoint a selection
        chose): written beside it, then swapped in by two renames, so a kill leaves the old final/ (or, between the
        renames, none: the cell is then not trained and trains again), never half of one."""
        new, old = self.path / ".final-new", self.path / ".final-old"
        for stale in (new, old):
            shutil.rmtree(stale, ignore_errors=True)
        new.mkdir()
        try:
            write(new)
        except BaseException:
            shutil.rmtree(new, ignore_errors=True)  # half a model is no final/, and it holds space
            raise
        if self.final.exists():
            os.replace(self.final, old)
        os.replace(new, self.final)
        shutil.rmtree(old, ignore_errors=True)

    # -- the first layout --------------------------------------------------------------------------------
    def config_id(self) -> str | None:
        try:
            return self.config().id()
        except Exception:  # noqa: BLE001 - a folder whose config no longer validates is not adopted
            return None

    def migrate(self) -> bool:
        """First layout -> this one, in place: the evaluation moves under its eval id, cell.json takes the new
        id, and a done cell with final weights counts as trained. Each step is atomic; the whole idempotent."""
        meta = self.meta()
        try:
            cfg = self.config()
        except Exception:  # noqa: BLE001 - see config_id
            return False
        if meta.get("layout") == LAYOUT:
            return False
        old, target = EvalFolder(self.eval_root), EvalFolder(self.eval_dir(cfg.eval.id()))
        status = self.status()
        if old.results_file.is_file() and not target.path.exists():
            target.path.mkdir(parents=True)
            for name in ("samples_file", "results_file"):  # results last: its presence means the move is done
                if getattr(old, name).is_file():
                    os.replace(getattr(old, name), getattr(target, name))
            res = read_json(target.results_file, dict) or {}
            if status.get("state") == "done" and not res.get("complete"):
                write_json(target.results_file, {**res, "complete": True})
        if status.get("state") == "done" and self.final.is_dir() and not status.get("trained"):
            write_json(self.status_file, {**status, "trained": True})
        write_json(self.meta_file, {**meta, "old_id": meta.get("id"), "id": cfg.id(), "layout": LAYOUT})
        return True

    # -- what the everyday commands need -----------------------------------------------------------------
    @property
    def method(self) -> str:
        return (self.raw_config().get("peft") or {}).get("method", "none")

    @property
    def base(self) -> str:
        """The base model as the cell named it: catalog alias, folder or hub id."""
        return self.raw_config()["model"]["name"]

    @property
    def title(self) -> str:
        meta = self.meta()
        return f"{meta.get('matrix', '?')}/{meta.get('slug', self.path.name)}"

    @property
    def label(self) -> str:
        """matrix/slug, as the leaderboard and `exp status` name the cell."""
        meta = self.meta()
        return f"{meta.get('matrix', self.path.parent.name)}/{meta.get('slug', self.path.name)}"


def open_cell(path: Path) -> CellFolder:
    """A user's path to a cell folder; UserError naming what it is instead."""
    if not path.is_dir():
        raise UserError("no such folder; expected a cell folder runs/<matrix>/<cell>/", file=path)
    folder = CellFolder(path)
    if not folder.exists():
        raise UserError("not a cell folder: it has no config.yaml and cell.json (a cell folder is "
                        "runs/<matrix>/<slug>-<id>/, as listed by `exp status runs/<matrix>`)", file=path)
    return folder


def open_finished(path: Path, command: str) -> CellFolder:
    """A cell that is done and has final/ weights; anything else is a UserError naming what is missing."""
    folder = open_cell(path)
    state = folder.status().get("state", "?")
    if state != "done":
        raise UserError(f"the cell is {state}, not done; `exp {command}` needs a finished cell "
                        f"(see `exp status {path.parent}`)", file=path)
    if not ((folder.final / "config.json").is_file() or (folder.final / "adapter_config.json").is_file()):
        raise UserError("the cell is done but has no final/ weights (train.save_final was false, or final/ was "
                        "removed); nothing to load", file=path)
    return folder
