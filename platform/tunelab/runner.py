"""The runner: runs each cell of a matrix in its own process, skips done ones, records failures.

It knows run directories, processes, locks and status, and nothing about models.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tunelab import events, folders
from tunelab.config import world_size as processes
from tunelab.launch import Launch, cell_command, sbatch_script
from tunelab.matrix import Cell
from tunelab.store import is_locked, read_status, write_json, write_status, write_text, write_yaml


@dataclass
class Outcome:
    cell: Cell
    state: str  # done | failed | pending | skipped-(done|failed|locked|queued) | submitted | written
    error: str | None = None


def select(cells: list[Cell], only: str | None) -> list[Cell]:
    if not only:
        return cells
    return [c for c in cells if fnmatch.fnmatch(c.slug, only) or fnmatch.fnmatch(c.id, only)
            or fnmatch.fnmatch(c.dirname, only)]


def cell_dir(matrix_dir: Path, cell: Cell) -> Path:
    """The trained model's id decides the folder: a cell whose slug changed (the matrix grew), or another
    evaluation of the same training, keeps the folder that exists."""
    return folders.find(matrix_dir, cell.id) or matrix_dir / cell.dirname


def write_index(matrix_dir: Path, cells: list[Cell]) -> None:
    """cells.json: the matrix as last run, so the leaderboard joins each cell's training and its evaluation."""
    write_json(matrix_dir / "cells.json", [{"id": c.id, "eval_id": c.eval_id, "slug": c.slug,
                                            "varying": c.varying} for c in cells])


def prepare(run_dir: Path, cell: Cell, matrix: str) -> None:
    write_yaml(run_dir / "config.yaml", cell.config.model_dump(mode="json"))
    write_json(run_dir / "cell.json", {"matrix": matrix, "id": cell.id, "slug": cell.slug,
                                       "varying": cell.varying, "layout": folders.LAYOUT})
    write_status(run_dir, "pending", created_at=time.time())


def world_size(cell: Cell) -> int:
    return processes(cell.config.parallel)


def node_log(run_dir: Path, node_rank: int) -> Path:
    """Where a node's share of a cell logs: cell.log on node 0; the other nodes write nothing into the cell's
    folder (it may be shared), theirs go to <matrix>/nodes/node-R/<cell>.log."""
    if node_rank == 0:
        return run_dir / "cell.log"
    path = run_dir.parent / "nodes" / f"node-{node_rank}" / f"{run_dir.name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def launch(run_dir: Path, on_event, command: list[str], log_path: Path | None = None) -> int:
    """Run the cell process; its stdout carries events (tunelab.events), its stderr goes to cell.log."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with (log_path or run_dir / "cell.log").open("a") as log:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        assert proc.stdout is not None
        for line in proc.stdout:
            event = events.decode(line)
            if event is None:
                log.write(line)
            else:
                on_event(event)
        return proc.wait()


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[info]}"), console=console, transient=False)


def _job_shape(run_dir: Path, cell: Cell, how: Launch) -> tuple[int, Launch]:
    """(processes, launch) of a cell's job: a trained cell only evaluates, on one process of one node."""
    if folders.is_trained(run_dir):
        return 1, replace(how, nnodes=1)
    return world_size(cell), how


def submit(jobs: list[tuple[Path, Cell]], how: Launch, matrix_dir: Path) -> list[Outcome]:
    """SLURM: write each cell's batch script (or one job array per process count, launcher.array) and submit
    it with sbatch unless this is a dry run; each cell's status keeps its job id (`exp status` shows it)."""
    groups: dict[tuple[int, ...], list[tuple[Path, Cell]]] = {}
    for i, (run_dir, cell) in enumerate(jobs):
        world, shape = _job_shape(run_dir, cell, how)
        key = (world, shape.nnodes) if how.slurm.array else (i,)
        groups.setdefault(key, []).append((run_dir, cell))
    outcomes = []
    for members in groups.values():
        world, shape = _job_shape(*members[0], how)
        if how.slurm.array:
            script = matrix_dir / f"slurm-array-{world}x{shape.nnodes}.sbatch"
            name = f"{matrix_dir.name}-{world}x{shape.nnodes}"
        else:
            script, name = members[0][0] / "slurm.sbatch", members[0][1].dirname
        write_text(script, sbatch_script([d for d, _ in members], world, shape, job_name=name))
        outcomes += _sbatch(script, members, how.dry_run, array=how.slurm.array)
    return outcomes


def _sbatch(script: Path, members: list[tuple[Path, Cell]], dry_run: bool, array: bool) -> list[Outcome]:
    if dry_run:
        return [Outcome(cell, "written", f"wrote {script}") for _, cell in members]
    out = subprocess.run(["sbatch", "--parsable", str(script)], check=False, capture_output=True, text=True)
    if out.returncode != 0:
        for run_dir, _ in members:
            write_status(run_dir, "failed", error=f"sbatch failed: {out.stderr.strip()}")
        return [Outcome(cell, "failed", out.stderr.strip()) for _, cell in members]
    job = out.stdout.strip().split(";")[0]  # --parsable: "id" or "id;cluster"
    outcomes = []
    for i, (run_dir, cell) in enumerate(members):
        task = f"{job}_{i}" if array else job
        write_status(run_dir, "pending", slurm_job=task)
        outcomes.append(Outcome(cell, "submitted", f"slurm job {task}"))
    return outcomes


def _queued(job: str | None) -> bool:
    """Whether SLURM still holds the job (pending, running, requeued): submitting the cell again would run it
    twice. Without squeue on PATH nothing is known: False."""
    if not job or shutil.which("squeue") is None:
        return False
    out = subprocess.run(["squeue", "--noheader", "--jobs", job, "--format=%T"], check=False, capture_output=True,
                         text=True)
    return out.returncode == 0 and bool(out.stdout.strip())


def _skip_reason(run_dir: Path, cell: Cell, rerun_failed: bool, how: Launch) -> str | None:
    status = read_status(run_dir)
    state = status.get("state")
    if state == "done" and folders.eval_done(run_dir, cell.eval_id):
        return "skipped-done"
    if state == "failed" and not rerun_failed:
        return "skipped-failed"
    if how.launcher == "slurm" and state in ("pending", "running") and _queued(status.get("slurm_job")):
        return "skipped-queued"
    return "skipped-locked" if is_locked(run_dir) else None


def _run_here(run_dir: Path, cell: Cell, how: Launch, progress: Progress) -> Outcome:
    """Start the cell's process(es) on this node, follow its events, and settle its status."""
    evaluate_only = folders.is_trained(run_dir)
    if evaluate_only and how.node_rank > 0:  # evaluation runs on one process, on node 0
        return Outcome(cell, "skipped-done", None)
    current = progress.add_task(f"  {cell.slug}", total=cell.config.train.steps, info="starting",
                                completed=cell.config.train.steps if evaluate_only else 0)

    def on_event(ev: events.Event) -> None:
        progress.update(current, **_shown(ev))

    command = cell_command(run_dir, 1, Launch()) if evaluate_only else cell_command(run_dir, world_size(cell), how)
    rc = launch(run_dir, on_event, command, node_log(run_dir, how.node_rank))
    if how.node_rank > 0:  # global rank 0 lives on node 0 and owns the cell's status
        return Outcome(cell, "done" if rc == 0 else "failed", None if rc == 0 else f"exit code {rc}")
    status = read_status(run_dir)
    if rc == 0 and status.get("state") == "done":
        progress.update(current, info="[green]done")
        return Outcome(cell, "done")
    if rc == 0 and status.get("state") == "pending":  # stopped by a signal, checkpoint written: run it again
        progress.update(current, info=f"[yellow]{status.get('note', 'stopped')}")
        return Outcome(cell, "pending", status.get("note"))
    if status.get("state") != "failed":  # died before it could say why (killed, out of memory)
        status = write_status(run_dir, "failed", error=f"cell process exited with code {rc}")
    progress.update(current, info=f"[red]failed: {status.get('error', '')[:80]}")
    return Outcome(cell, "failed", status.get("error"))


def _shown(ev: events.Event) -> dict:
    """How an event shows on the cell's progress line."""
    if isinstance(ev, events.Step):
        return {"completed": ev.step, "info": f"train loss {ev.loss:.4f}"}
    if isinstance(ev, events.EvalProgress):
        return {"info": f"eval {ev.task} {ev.done}/{ev.total}"}
    if isinstance(ev, events.EvalTask):
        return {"info": f"eval {ev.task}"}
    if isinstance(ev, events.Resumed):
        return {"completed": ev.step, "info": f"resumed from {ev.checkpoint}"}
    return {"info": ev.name}


def run_cells(cells: list[Cell], matrix: str, runs_dir: Path, *, rerun_failed: bool = False,
              fail_fast: bool = False, console: Console | None = None, how: Launch | None = None) -> list[Outcome]:
    console = console or Console(stderr=True)
    how = how or Launch()
    outcomes: list[Outcome] = []
    to_submit: list[tuple[Path, Cell]] = []
    with _progress(console) as progress:
        overall = progress.add_task(f"[bold]{matrix}", total=len(cells), info="")
        for cell in cells:
            run_dir = cell_dir(runs_dir / matrix, cell)
            skip = _skip_reason(run_dir, cell, rerun_failed, how)
            if skip:
                outcome = Outcome(cell, skip, read_status(run_dir).get("error"))
                progress.console.print(f"[dim]{cell.dirname}: {skip.removeprefix('skipped-')}, skipped")
            else:
                if how.node_rank == 0:
                    prepare(run_dir, cell, matrix)
                if how.launcher == "slurm":  # submitted together below (job arrays group cells)
                    to_submit.append((run_dir, cell))
                    continue
                outcome = _run_here(run_dir, cell, how, progress)
            outcomes.append(outcome)
            progress.advance(overall)
            if fail_fast and outcome.state == "failed":
                break
        for outcome in submit(to_submit, how, runs_dir / matrix) if to_submit else []:
            progress.console.print(f"{outcome.cell.dirname}: {outcome.error}")
            outcomes.append(outcome)
            progress.advance(overall)
    return outcomes
