"""`exp status`: the state of every cell of a matrix's run folder, and why failed cells failed.

A cell of the matrix as last run (cells.json) that has no folder yet was never started: it is pending.
"""

from __future__ import annotations

from typing import Any

from tunelab.folders.matrix import MatrixFolder

STATE_NOTES = {
    "interrupted": "stopped by Ctrl-C, or killed from outside (out of memory, a user, a lost machine: its status "
                   "says running, but no process holds its folder's lock); `exp run` resumes it from its last "
                   "checkpoint",
    "failed": "`exp run --rerun-failed` retries failed cells (a cell that failed for bad input is retried by a plain "
              "`exp run` once that input changed); the whole log is the cell folder's cell.log",
    "pending": "not started yet, or stopped in order (Ctrl-C, preemption): `exp run` starts or resumes it",
}


def rows(matrix: MatrixFolder) -> list[dict[str, Any]]:
    out = []
    for f in matrix.cells():
        st, meta = f.status(), f.meta()
        out.append({"cell": meta.get("slug", f.path.name), "id": meta.get("id"), "dir": str(f.path),
                    "state": f.state(), "timings": st.get("timings") or {}, "disk_bytes": f.disk_usage(),
                    "error": st.get("error"), "exit": st.get("exit"), "log_tail": st.get("log_tail") or [],
                    "slurm_job": st.get("slurm_job"), "note": st.get("note") if st.get("state") != "done" else None})
    started = {r["id"] for r in out}
    for entry in matrix.index() or []:
        if isinstance(entry, dict) and entry.get("id") not in started:  # in the matrix, never started
            out.append({"cell": entry.get("slug", "?"), "id": entry.get("id"), "dir": None, "state": "pending",
                        "timings": {}, "disk_bytes": 0, "error": None, "exit": None, "log_tail": [],
                        "slurm_job": None, "note": "not started yet"})
    return out
