"""`exp status`: the state of every cell of a matrix's run folder, and why failed cells failed.

A cell of the matrix as last run (cells.json) that has no folder yet was never started: it is pending.
"""

from __future__ import annotations

from typing import Any

from tunelab.core.files import read_json
from tunelab.folders.matrix import REWRITE, MatrixFolder
from tunelab.folders.targets import names
from tunelab.machine.load import strain

STATE_NOTES = {
    "interrupted": "stopped by Ctrl-C, or killed from outside (out of memory, a user, a lost machine: its status "
                   "says running, but no process holds its folder's lock); `exp run` resumes it from its last "
                   "checkpoint",
    "failed": "`exp run --rerun-failed` retries failed cells (a cell that failed for bad input is retried by a plain "
              "`exp run` once that input changed); the whole log is the cell folder's cell.log",
    "pending": "not started yet, or stopped in order (Ctrl-C, preemption): `exp run` starts or resumes it",
    "pruned": "a search's trial stopped at a rung for good (`exp tune status` shows its values); it never trains "
              "again",
}


def rows(matrix: MatrixFolder) -> list[dict[str, Any]]:
    out = []
    cells = matrix.cells()
    label = names(cells)  # a slug two cells share (runs with other --set values): their folders' names
    for f in cells:
        st, meta = f.status(), f.meta()
        out.append({"cell": label[f.path], "id": meta.get("id"), "dir": str(f.path),
                    "state": f.state(), "timings": st.get("timings") or {}, "disk_bytes": f.disk_usage(),
                    "error": st.get("error"), "exit": st.get("exit"), "log_tail": st.get("log_tail") or [],
                    "slurm_job": st.get("slurm_job"), "note": st.get("note") if st.get("state") != "done" else None,
                    "machine": strain(f.metrics())})  # its steps slowed down, its CPUs were busy: the figures
    trials = search_trials(matrix)
    for r in out:
        trial = trials.get(str(r["id"]), {})
        if trial.get("state") == "pruned":  # stopped at a rung for good: not a pending cell
            r["state"], r["note"] = "pruned", trial["note"]
    started = {r["id"] for r in out}
    for entry in [*(matrix.index() or []), *trials.values()]:
        if isinstance(entry, dict) and entry.get("id") not in started:  # in the matrix, never started
            started.add(entry.get("id"))
            out.append({"cell": entry.get("slug", "?"), "id": entry.get("id"), "dir": None, "state": "pending",
                        "timings": {}, "disk_bytes": 0, "error": None, "exit": None, "log_tail": [],
                        "slurm_job": None, "note": entry.get("note", "not started yet"), "machine": None})
    return out


def search_trials(matrix: MatrixFolder) -> dict[str, dict[str, Any]]:
    """Every trial of the matrix's searches as its study's trials.json lists it, by cell id: those not started
    yet too (a search stopped mid-rung has sampled them all); {} without searches."""
    out: dict[str, dict[str, Any]] = {}
    for entry in read_json(matrix.studies_file, list, REWRITE) or []:
        if not isinstance(entry, dict):
            continue
        table = read_json(matrix.trials_file(entry.get("study", "")), dict, REWRITE)
        if not isinstance(table, dict):
            continue
        for t in table.get("trials", []):
            pruned = t.get("state") == "pruned"
            if pruned and t["cell"] in out:  # a point drawn twice: the trial that went on says what its cell is
                continue
            out[t["cell"]] = {"id": t["cell"], "slug": f"{table.get('group')}-t{t['number']:02d}",
                              "state": t.get("state"),
                              "note": f"pruned at step {t.get('pruned_at')} by its search" if pruned else
                              f"trial {t['number']} of the search of {table.get('group')}: not started yet"}
    return out
