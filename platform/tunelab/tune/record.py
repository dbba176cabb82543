"""The Optuna study of a search: where `optuna-dashboard` and `exp tune status` read it.

It is a record, written from what the cells say: the driver syncs it after every rung (trials created in number
order with their points, intermediate values at the rungs, pruned and complete states, each rung's decision as a
study attribute). Everything in it follows from the matrix file and the cell folders, so writing it again
changes nothing, and two runners writing it at once (under the study's lock in the runs folder) write the same.

Storage: `journal` (default) is an Optuna journal file, runs/<matrix>/tune/optuna.journal (`optuna-dashboard
runs/<matrix>/tune/optuna.journal` opens it live); `postgresql://user@host:port/db` (or `sqlite:///file`) an
Optuna RDB storage, shared by every node of a cluster.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage
from optuna.storages.journal import JournalFileOpenLock
from optuna.trial import FrozenTrial, TrialState, create_trial

from tunelab.core.errors import UserError
from tunelab.core.files import warn
from tunelab.folders.matrix import MatrixFolder

JOURNAL = MatrixFolder.journal_file.name  # the study file in runs/<matrix>/tune/
STATES = {"waiting": TrialState.RUNNING, "pruned": TrialState.PRUNED, "complete": TrialState.COMPLETE,
          "failed": TrialState.FAIL}


@dataclass
class TrialView:
    """One trial as the search knows it (tunelab's trial number is Optuna's)."""

    number: int
    bracket: int
    params: dict[str, Any]
    cell: str  # the cell id
    intermediate: dict[int, float] = field(default_factory=dict)
    state: str = "waiting"  # waiting (in the search, not finished) | pruned | complete | failed (no usable value)
    value: float | None = None
    reached: int = 0  # steps trained
    pruned_at: int | None = None
    note: str = ""


def shown_url(url: str) -> str:
    """A storage URL without its password, for messages and files."""
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


class _KernelLock(JournalFileOpenLock):
    """The journal's writer lock as a flock: the kernel frees it when its holder dies however it dies (kill -9),
    where Optuna's file locks stay behind for their 30 s grace period. (A subclass of a public lock: Optuna
    keeps the base class private.)"""

    # No super().__init__(): it would set up the lock file this one replaces.
    def __init__(self, path: Path) -> None:
        self._path: Path = path
        self._file: IO[str] | None = None

    def acquire(self) -> bool:
        f = self._path.open("a")
        fcntl.flock(f, fcntl.LOCK_EX)
        self._file = f
        return True

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def repair_journal(matrix_dir: Path, say: Callable[[str], None] = warn) -> None:
    """Cut a journal line a kill tore (no newline at its end), as Optuna's reader would skip it: the next record
    must not run into it. A damaged line before the last (not UTF-8, not JSON: Optuna's reader stops there) moves
    the journal aside, said with its line (`say`): the study is a record of the cells, and the next `sync` writes
    it again whole. Called by the only writer, under the tune folder's lock."""
    folder = MatrixFolder(matrix_dir)
    path = folder.journal_file
    if path.is_file() and path.stat().st_size:
        data = path.read_bytes()
        if not data.endswith(b"\n"):
            with path.open("r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
        damage = damaged_line(data)
        if damage is not None:
            os.replace(path, folder.damaged_journal_file)
            say(f"{path}: line {damage[0]} is {damage[1]}; the journal was moved aside to "
                f"{folder.damaged_journal_file} and its studies are written again from the trials' cells")


def damaged_line(data: bytes) -> tuple[int, str] | None:
    """(line number, what is wrong) of the first complete journal line that is not a JSON object, or None."""
    for n, line in enumerate(data.split(b"\n")[:-1], 1):
        try:
            if isinstance(json.loads(line.decode("utf-8")), dict):
                continue
            why = "not a JSON object"
        except UnicodeDecodeError as e:
            why = f"not UTF-8 (byte {e.start})"
        except json.JSONDecodeError as e:
            why = f"not JSON ({e.msg})"
        return n, why
    return None


def damaged_journal(matrix_dir: Path) -> UserError | None:
    """The paragraph for a reader (`exp tune status`) of a journal with a damaged line; None when it has none."""
    path = MatrixFolder(matrix_dir).journal_file
    try:
        damage = damaged_line(path.read_bytes())
    except OSError:
        return None
    if damage is None:
        return None
    return UserError(f"line {damage[0]} is {damage[1]}: the journal was damaged since it was written. The next "
                     "`exp run` of the matrix moves it aside and writes its studies again from the trials' cells "
                     "(or delete it; the same happens)", file=path)


def open_storage(url: str, matrix_dir: Path) -> BaseStorage:
    """The study storage of a `tune.storage` value; UserError when it cannot be reached."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if url == "journal":
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        folder = MatrixFolder(matrix_dir)
        folder.tune_dir.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(folder.journal_file),
                                                 lock_obj=_KernelLock(folder.journal_lock_file)))
    try:
        return optuna.storages.RDBStorage(url)
    except Exception as e:  # noqa: BLE001 - a driver, a refused connection, a bad URL: one message
        raise _cannot_open(url, e) from None


def check_reachable(url: str) -> None:
    """Before anything trains: a database storage's server answers. A connection only: opening the storage makes
    its tables, which runners starting at once would race to do (the search opens it under the tune folder's
    lock)."""
    import sqlalchemy

    try:
        engine = sqlalchemy.create_engine(url)
        try:
            with engine.connect():
                pass
        finally:
            engine.dispose()  # the probe's pooled connection is not kept open while the cells train
    except Exception as e:  # noqa: BLE001 - as open_storage
        raise _cannot_open(url, e) from None


def _cannot_open(url: str, e: Exception) -> UserError:
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    return UserError(f"tune.storage {shown_url(url)}: cannot open the study storage ({first}); is the server "
                     "running and the database created? (postgresql:// needs psycopg: pip install "
                     "'psycopg[binary]'; postgresql+psycopg2:// needs psycopg2)")


def study_id(storage: BaseStorage, name: str, direction: str) -> int:
    try:
        return storage.get_study_id_from_name(name)
    except KeyError:
        pass
    try:
        return storage.create_new_study([optuna.study.StudyDirection[direction.upper()]], name)
    except optuna.exceptions.DuplicatedStudyError:  # another node created it a moment ago
        return storage.get_study_id_from_name(name)


def sync(storage: BaseStorage, name: str, direction: str, space: dict[str, BaseDistribution],
         views: list[TrialView], attrs: dict[str, Any]) -> None:
    """Make the study say what `views` say: missing trials created in number order, missing intermediate values
    added, finished states set once. A stored trial that contradicts the views (another point, another end) is an
    error: the study was written by another version of the search."""
    sid = study_id(storage, name, direction)
    stored = {t.number: t for t in storage.get_all_trials(sid, deepcopy=False)}
    for view in sorted(views, key=lambda v: v.number):
        trial = stored.get(view.number) or _create(storage, sid, view, space)
        _check_same(trial, view, name)
        if trial.state.is_finished():  # Optuna keeps a finished trial as it is
            continue
        for step, value in sorted(view.intermediate.items()):
            if step not in trial.intermediate_values:
                storage.set_trial_intermediate_value(trial._trial_id, step, value)
        _finish(storage, trial, view)
    for key, value in attrs.items():
        storage.set_study_user_attr(sid, key, value)


def _create(storage: BaseStorage, sid: int, view: TrialView, space: dict[str, BaseDistribution]) -> FrozenTrial:
    template = create_trial(state=TrialState.RUNNING, params=view.params,
                            distributions={k: space[k] for k in view.params},
                            user_attrs={"cell": view.cell, "bracket": view.bracket})
    trial = storage.get_trial(storage.create_new_trial(sid, template_trial=template))
    if trial.number != view.number:
        raise UserError(f"study {trial.number}: trial {view.number} was stored as number {trial.number}: the study "
                        "was written by something other than this search; delete it or rename the matrix")
    return trial


def _check_same(trial: FrozenTrial, view: TrialView, name: str) -> None:
    if trial.params != view.params:
        raise UserError(f"study {name}: trial {view.number} is stored with {trial.params}, but this search samples "
                        f"{view.params} (another Optuna version, or an edited study)")
    want = STATES[_state(view)]
    # A waiting view is only behind the record (this pass has not reached the trial's end yet); an end is an end.
    if trial.state.is_finished() and view.state != "waiting" and trial.state != want:
        raise UserError(f"study {name}: trial {view.number} is stored {trial.state.name}, but its cell says "
                        f"{want.name}")


def _state(view: TrialView) -> str:
    """A complete trial whose objective is not a number (a diverged run) is a failed one to Optuna."""
    if view.state == "complete" and (view.value is None or math.isnan(view.value)):
        return "failed"
    return view.state


def _finish(storage: BaseStorage, trial: FrozenTrial, view: TrialView) -> None:
    state = _state(view)
    storage.set_trial_user_attr(trial._trial_id, "reached", view.reached)
    if view.note:
        storage.set_trial_user_attr(trial._trial_id, "note", view.note)
    if view.pruned_at is not None:
        storage.set_trial_user_attr(trial._trial_id, "pruned_at", view.pruned_at)
    if state == "waiting":
        return
    values = [view.value] if state == "complete" and view.value is not None else None
    storage.set_trial_state_values(trial._trial_id, STATES[state], values)


def load(storage: BaseStorage, name: str) -> tuple[dict[str, Any], list[FrozenTrial]]:
    """(study user attributes, trials) of a stored study."""
    sid = storage.get_study_id_from_name(name)
    return storage.get_study_user_attrs(sid), storage.get_all_trials(sid)
