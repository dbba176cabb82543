"""The runner: runs each cell of a matrix in its own process, skips done ones, records failures.

It knows run directories, processes, locks and status, and nothing about models.
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tunelab.matrix import Cell
from tunelab.store import is_locked, read_status, write_json, write_status, write_yaml


@dataclass
class Outcome:
    cell: Cell
    state: str  # done | failed | skipped-done | skipped-failed | skipped-locked
    error: str | None = None


def select(cells: list[Cell], only: str | None) -> list[Cell]:
    if not only:
        return cells
    return [c for c in cells if fnmatch.fnmatch(c.slug, only) or fnmatch.fnmatch(c.id, only)
            or fnmatch.fnmatch(c.dirname, only)]


def cell_dir(matrix_dir: Path, cell: Cell) -> Path:
    """The id decides the folder: a cell whose slug changed (the matrix grew) keeps its old one."""
    existing = sorted(p.parent for p in matrix_dir.glob(f"*-{cell.id}/cell.json"))
    return existing[0] if existing else matrix_dir / cell.dirname


def prepare(run_dir: Path, cell: Cell, matrix: str) -> None:
    write_yaml(run_dir / "config.yaml", cell.config.model_dump(mode="json"))
    write_json(run_dir / "cell.json", {"matrix": matrix, "id": cell.id, "slug": cell.slug,
                                       "varying": cell.varying})
    write_status(run_dir, "pending", created_at=time.time())


def launch(run_dir: Path, on_event) -> int:
    """Run the cell process; its stdout carries JSON events, its stderr goes to cell.log."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with (run_dir / "cell.log").open("a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tunelab.cell", str(run_dir)], stdout=subprocess.PIPE,
                                stderr=log, text=True, env=env)
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                on_event(json.loads(line))
            except json.JSONDecodeError:
                log.write(line)
        return proc.wait()


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[info]}"), console=console, transient=False)


def run_cells(cells: list[Cell], matrix: str, runs_dir: Path, *, rerun_failed: bool = False,
              fail_fast: bool = False, console: Console | None = None) -> list[Outcome]:
    console = console or Console(stderr=True)
    outcomes: list[Outcome] = []
    with _progress(console) as progress:
        overall = progress.add_task(f"[bold]{matrix}", total=len(cells), info="")
        for cell in cells:
            run_dir = cell_dir(runs_dir / matrix, cell)
            state = read_status(run_dir).get("state")
            skip = ("skipped-done" if state == "done" else
                    "skipped-failed" if state == "failed" and not rerun_failed else
                    "skipped-locked" if is_locked(run_dir) else None)
            if skip:
                outcomes.append(Outcome(cell, skip, read_status(run_dir).get("error")))
                progress.console.print(f"[dim]{cell.dirname}: {skip.removeprefix('skipped-')}, skipped")
                progress.advance(overall)
                continue
            prepare(run_dir, cell, matrix)
            current = progress.add_task(f"  {cell.slug}", total=cell.config.train.steps, info="starting")

            def on_event(ev: dict, task=current) -> None:
                if ev.get("stage") == "train":
                    progress.update(task, completed=ev["step"], info=f"train loss {ev['loss']:.4f}")
                else:
                    progress.update(task, info=" ".join(str(v) for v in ev.values()))

            rc = launch(run_dir, on_event)
            status = read_status(run_dir)
            if rc != 0 or status.get("state") != "done":
                if status.get("state") != "failed":  # died before it could say why (killed, OOM)
                    status = write_status(run_dir, "failed", error=f"cell process exited with code {rc}")
                outcomes.append(Outcome(cell, "failed", status.get("error")))
                progress.update(current, info=f"[red]failed: {status.get('error', '')[:80]}")
            else:
                outcomes.append(Outcome(cell, "done"))
                progress.update(current, info="[green]done")
            progress.advance(overall)
            if fail_fast and outcomes[-1].state == "failed":
                break
    return outcomes
