"""The runner: runs each cell of a matrix in its own process, skips done ones, records failures.

It knows run directories, processes, locks and status, and nothing about models.

A cell runs under its folder's lock (store.CellLock), taken by the runner before it writes anything there and
handed to the cell process, so two runners on one matrix never run a cell twice: a runner that finds a cell
locked goes on with the others and comes back to wait for it, then reports it done (or takes it over, if its
holder died without finishing: the kernel freed the lock, and a status still saying "running" is only the
dead process's last word). A cell process that dies is marked failed with its cause: the signal's name or the
exit code, and the last lines of its cell.log.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from tunelab import events, folders
from tunelab.config import world_size as processes
from tunelab.launch import Launch, cell_command, sbatch_script
from tunelab.matrix import Cell
from tunelab.store import (
    LOCK_HELD_ENV,
    LOCKED_EXIT,
    CellLock,
    is_locked,
    lock_holder,
    read_json,
    read_status,
    write_json,
    write_status,
    write_text,
    write_yaml,
)

LOG_TAIL_LINES = 20  # of cell.log, kept in status.json when a cell fails


@dataclass
class Outcome:
    cell: Cell
    # done | done-elsewhere (another runner finished it) | failed | interrupted (it will resume) |
    # skipped-done | skipped-failed | skipped-locked | skipped-queued (SLURM holds its job) | submitted | written
    state: str
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


def launch(run_dir: Path, on_event, command: list[str], held: CellLock | None = None,
           log_path: Path | None = None) -> int:
    """Run the cell process; its stdout carries events (tunelab.events), its stderr goes to cell.log (or
    `log_path`). `held`: the folder's lock, which the cell process inherits (it outlives this process if it must)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    fds: tuple[int, ...] = ()
    if held is not None:
        env[LOCK_HELD_ENV], fds = str(run_dir.resolve()), (held.fileno(),)
    with (log_path or run_dir / "cell.log").open("a") as log:
        # Each attempt begins with a line of its own: the log of a resumed cell reads as its history.
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} runner pid {os.getpid()} on {socket.gethostname()} "
                  f"starts: {' '.join(command)}\n")
        log.flush()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env, pass_fds=fds)
        if held is not None:
            held.note(f"cell process pid {proc.pid}")
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
                    TimeRemainingColumn(),
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


def _skip_reason(run_dir: Path, cell: Cell, rerun_failed: bool, how: Launch, probe_lock: bool = True) -> str | None:
    status = read_status(run_dir)
    state = status.get("state")
    if state == "done" and folders.eval_done(run_dir, cell.eval_id):
        return "skipped-done"
    if state == "failed" and not rerun_failed:
        return "skipped-failed"
    if how.launcher == "slurm" and state in ("pending", "running") and _queued(status.get("slurm_job")):
        return "skipped-queued"
    return "skipped-locked" if probe_lock and is_locked(run_dir) else None


def exit_cause(rc: int, log_tail: list[str] = ()) -> str:
    """An exit status in words: a signal by its name and what usually sends it. torchrun exits 1 when a
    worker dies; the worker's own exit code is then taken from torchrun's report in the log."""
    if rc > 0:
        worker = [int(m.group(1)) for line in log_tail if (m := re.search(r"exitcode\s*:\s*(-\d+)", line))]
        if worker:
            return f"{exit_cause(worker[-1])} (a worker process; torchrun exited with code {rc})"
    sig = -rc if rc < 0 else rc - 128 if rc > 128 else None  # 128+N: a shell's way of saying signal N
    try:
        name = signal.Signals(sig).name if sig else None
    except ValueError:
        name = None
    if name is None:
        return f"exited with code {rc}"
    why = {"SIGKILL": "the kernel's out-of-memory killer (see `dmesg`), the batch system or a user",
           "SIGTERM": "the batch system (time limit, preemption), a shutdown or a user",
           "SIGINT": "Ctrl-C", "SIGSEGV": "a crash in native code (a library, a kernel driver)",
           "SIGBUS": "a crash in native code, or a memory-mapped file that went away",
           "SIGABRT": "a crash: native code aborted", "SIGILL": "a crash: an instruction this CPU lacks",
           "SIGFPE": "a crash in native code"}.get(name)
    return f"killed by {name}" + (f": usually {why}" if why else "")


def log_tail(run_dir: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last lines of cell.log (its last 64 KiB at most), each cut at 400 characters."""
    path = run_dir / "cell.log"
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [line[:400] for line in text.splitlines() if line.strip()][-lines:]


def _settle(run_dir: Path, rc: int) -> dict:
    """The cell process ended: its status as it left it, or failed with the cause when it died without
    finishing (a status still "running"), always with the exit and the log's last lines when not done."""
    status = read_status(run_dir)
    if rc == 0 and status.get("state") == "done":
        return status
    if status.get("state") == "pending":  # it stopped itself in order (Ctrl-C, preemption): it will resume
        return status
    tail = log_tail(run_dir)
    cause = exit_cause(rc, tail)
    if status.get("state") == "failed":  # it said why itself; the exit and the log go beside it
        return write_status(run_dir, "failed", exit=cause, log_tail=tail)
    error = f"cell process {cause}" if rc != 0 else "cell process exited without finishing (exit code 0)"
    return write_status(run_dir, "failed", error=error, exit=cause, log_tail=tail, finished_at=time.time())


def _run_here(run_dir: Path, cell: Cell, how: Launch, progress: Progress, held: CellLock | None = None) -> Outcome:
    """Start the cell's process(es) on this node, follow its events, and settle its status."""
    evaluate_only = folders.is_trained(run_dir)
    if evaluate_only and how.node_rank > 0:  # evaluation runs on one process, on node 0
        return Outcome(cell, "skipped-done", None)
    current = progress.add_task(f"  {cell.slug}", total=cell.config.train.steps, info="starting",
                                completed=cell.config.train.steps if evaluate_only else 0)

    def on_event(ev: events.Event) -> None:
        progress.update(current, **_shown(ev))

    command = cell_command(run_dir, 1, Launch()) if evaluate_only else cell_command(run_dir, world_size(cell), how)
    rc = launch(run_dir, on_event, command, held, node_log(run_dir, how.node_rank))
    if how.node_rank > 0:  # global rank 0 lives on node 0 and owns the cell's status
        return Outcome(cell, "done" if rc == 0 else "failed", None if rc == 0 else exit_cause(rc))
    if rc == LOCKED_EXIT and held is None and read_status(run_dir).get("state") != "failed":
        progress.update(current, info="[yellow]locked by another process")
        return Outcome(cell, "skipped-locked", f"locked by another process ({lock_holder(run_dir)})")
    status = _settle(run_dir, rc)
    if status.get("state") == "done":
        progress.update(current, info="[green]done")
        return Outcome(cell, "done")
    if status.get("state") == "pending":
        progress.update(current, info="[yellow]interrupted: resumes on the next exp run")
        return Outcome(cell, "interrupted", status.get("note") or exit_cause(rc))
    progress.update(current, info=f"[red]failed: {status.get('error', '')[:80]}")
    return Outcome(cell, "failed", status.get("error"))


def _claimed(run_dir: Path, cell: Cell, matrix: str, how: Launch, progress: Progress, held: CellLock,
             rerun_failed: bool, waited: bool) -> Outcome:
    """Run a cell whose lock this runner holds, unless it turned done or failed before the lock was ours."""
    skip = _skip_reason(run_dir, cell, rerun_failed, how, probe_lock=False)
    if skip == "skipped-done":  # it was not when this runner looked first: another process finished it
        _say(progress, f"{cell.dirname}: done by another process")
        return Outcome(cell, "done-elsewhere")
    if skip:
        _say(progress, f"[dim]{cell.dirname}: failed in another process, skipped")
        return Outcome(cell, skip, read_status(run_dir).get("error"))
    if waited:
        _say(progress, f"{cell.dirname}: its lock is free and it is not done: running it here")
    results = folders.eval_dir(run_dir, cell.eval_id) / "results.json"
    if results.is_file() and read_json(results) is None:  # damaged since (atomic writes never cut one short)
        _say(progress, f"{cell.dirname}: {results} is not readable JSON: evaluating it again")
    prepare(run_dir, cell, matrix)
    return _run_here(run_dir, cell, how, progress, held)


def _say(progress: Progress, text: str) -> None:
    progress.console.print(text, soft_wrap=True, highlight=False)  # paths and pids stay whole, to be copied


def _wait_for(run_dir: Path, cell: Cell, progress: Progress) -> CellLock:
    _say(progress, f"{cell.dirname}: waiting for the process that holds its lock ({lock_holder(run_dir)})")
    held = CellLock(run_dir)
    held.acquire(wait=None)
    return held


def _shown(ev: events.Event) -> dict:
    """How an event shows on the cell's progress line."""
    if isinstance(ev, events.Step):
        return {"completed": ev.step, "info": f"train loss {ev.loss:.4f}"}
    if isinstance(ev, events.EvalProgress):  # the cell's bar follows the task's items (and shows their ETA)
        return {"total": ev.total, "completed": ev.done, "info": f"eval {ev.task} {ev.done}/{ev.total}"}
    if isinstance(ev, events.DataProgress):
        return {"info": f"tokenizing {ev.done}/{ev.total}"}
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
    # Local cells run under the lock this runner takes (node 0: the other nodes follow its torchrun).
    claims = how.launcher == "local" and how.node_rank == 0
    locked_elsewhere: list[tuple[Cell, Path]] = []  # come back to them once the others are done
    to_submit: list[tuple[Path, Cell]] = []
    with _progress(console) as progress:
        overall = progress.add_task(f"[bold]{matrix}", total=len(cells), info="")
        for cell in cells:
            run_dir = cell_dir(runs_dir / matrix, cell)
            # Another node's lock is no reason to skip: nodes R > 0 join the cell node 0 holds.
            skip = _skip_reason(run_dir, cell, rerun_failed, how, probe_lock=not claims and how.node_rank == 0)
            if skip:
                outcome = Outcome(cell, skip, read_status(run_dir).get("error"))
                progress.console.print(f"[dim]{cell.dirname}: {skip.removeprefix('skipped-')}, skipped")
            elif claims:
                held = CellLock(run_dir)
                if not held.acquire(wait=0):
                    _say(progress, f"{cell.dirname}: locked by another process ({lock_holder(run_dir)}); "
                                   "coming back to it")
                    locked_elsewhere.append((cell, run_dir))
                    continue
                with held:
                    outcome = _claimed(run_dir, cell, matrix, how, progress, held, rerun_failed, waited=False)
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
                return outcomes
        for cell, run_dir in locked_elsewhere:
            with _wait_for(run_dir, cell, progress) as held:
                outcome = _claimed(run_dir, cell, matrix, how, progress, held, rerun_failed, waited=True)
            outcomes.append(outcome)
            progress.advance(overall)
            if fail_fast and outcome.state == "failed":
                break
        for outcome in submit(to_submit, how, runs_dir / matrix) if to_submit else []:
            progress.console.print(f"{outcome.cell.dirname}: {outcome.error}")
            outcomes.append(outcome)
            progress.advance(overall)
    return outcomes
