"""`exp tune status runs/<matrix>`: each search as its Optuna study says, with what its cells are doing now."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from tunelab.core.errors import UserError
from tunelab.core.files import read_json
from tunelab.folders.cell import CellFolder
from tunelab.folders.matrix import REWRITE, MatrixFolder
from tunelab.matrix.tune_section import Dist
from tunelab.tune import edges, record

STATE = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned", TrialState.FAIL: "failed",
         TrialState.RUNNING: "waiting", TrialState.WAITING: "waiting"}


def trial_row(matrix_dir: Path, t: FrozenTrial) -> dict[str, Any]:
    """One trial: its point, where it stands, its values; `waiting` turns `running` while a process holds its cell."""
    state = STATE.get(t.state, t.state.name.lower())
    cell = t.user_attrs.get("cell")
    d = MatrixFolder(matrix_dir).find(cell) if cell else None
    if state == "waiting" and d is not None:
        state = _waiting(d)
    return {"number": t.number, "bracket": t.user_attrs.get("bracket"), "params": t.params, "state": state,
            "intermediate": {int(k): v for k, v in sorted(t.intermediate_values.items())},
            "value": t.value, "reached": t.user_attrs.get("reached", 0), "pruned_at": t.user_attrs.get("pruned_at"),
            "note": t.user_attrs.get("note"), "cell": cell, "dir": str(d.path) if d else None}


def _waiting(d: CellFolder) -> str:
    """A trial in the search, not finished: running (a process holds its cell), stopped (Ctrl-C, a kill: it resumes
    on the next `exp run`), failed (its cell), or waiting (paused at its rung for the decision, or not started)."""
    if d.is_locked():
        return "running"
    status = d.status()
    if d.state() in ("failed", "interrupted"):
        return "failed" if d.state() == "failed" else "stopped"
    if status.get("state") == "pending" and status.get("paused_at") is None and status.get("note"):
        return "stopped"  # it said how it stopped (paused at a rung it would not: that is its search's wait)
    return "waiting"


def study_row(matrix_dir: Path, entry: dict[str, Any]) -> dict[str, Any]:
    try:
        storage = record.open_storage(entry["storage"], matrix_dir)
        attrs, stored = record.load(storage, entry["study"])
    except KeyError:  # listed, but its first stage has not ended yet
        attrs, stored = {}, []
    except ValueError as e:  # Optuna's journal reader stops at a damaged line (JSONDecodeError is one)
        raise record.damaged_journal(matrix_dir) or e from None
    info = attrs.get("tunelab") or {}
    rows = [trial_row(matrix_dir, t) for t in stored]
    done = [r for r in rows if r["state"] == "complete" and r["value"] is not None]
    best = (max if info.get("direction") == "maximize" else min)(done, key=lambda r: r["value"], default=None)
    count = {s: sum(r["state"] == s for r in rows)
             for s in ("complete", "pruned", "failed", "running", "stopped", "waiting")}
    return {"group": entry["group"], "study": entry["study"], "study_index": entry.get("study_index", 0),
            "studies": entry.get("studies", 1), "edges": _edges(matrix_dir, entry, best and best["params"]),
            "storage": record.shown_url(entry["storage"]),
            "metric": info.get("metric"), "schedule": info.get("schedule"), "trials": rows, **count,
            "best": best and {"number": best["number"], "value": best["value"], "params": best["params"]},
            "steps": sum(r["reached"] or 0 for r in rows), "planned_steps": info.get("planned_steps"),
            "full_steps": info.get("full_steps"), "decisions": attrs.get("decisions", [])}


def _edges(matrix_dir: Path, entry: dict[str, Any], params: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The searched keys whose best value so far lies at an edge of its range (tune/edges.py), from the space
    trials.json records."""
    table = read_json(matrix_dir / entry["trials_file"], dict, REWRITE) or {}
    if not params or not table.get("space"):
        return []
    space = {k: Dist.model_validate(d) for k, d in table["space"].items()}
    return [asdict(e) for e in edges.of(space, params)]


def collect(matrix_dir: Path) -> list[dict[str, Any]]:
    index = read_json(MatrixFolder(matrix_dir).studies_file, list, REWRITE)
    if index is None:
        raise UserError("no searches here (no tune/studies.json): `exp run` a matrix with a tune: section first",
                        file=matrix_dir)
    return [study_row(matrix_dir, entry) for entry in index]
