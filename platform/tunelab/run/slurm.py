"""`exp run --launcher slurm`: each cell (or a job array of cells with the same shape) as an sbatch job.

The batch script (launch.sbatch_script) runs the same cell entry point as a local run; a job's status.json
keeps its job id, so a second `exp run` neither submits a queued cell again nor loses track of it.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace

from tunelab.core.files import write_text
from tunelab.folders.cell import CellFolder
from tunelab.folders.matrix import MatrixFolder
from tunelab.matrix.expansion import Cell
from tunelab.run.launch import Launch, sbatch_script
from tunelab.run.outcome import Outcome

Job = tuple[CellFolder, Cell]


def job_shape(folder: CellFolder, cell: Cell, how: Launch) -> tuple[int, Launch]:
    """(processes, launch) of a cell's job: a trained cell only evaluates, on one process of one node."""
    if folder.is_trained():
        return 1, replace(how, nnodes=1)
    return cell.world_size, how


def submit(jobs: list[Job], how: Launch, matrix: MatrixFolder) -> list[Outcome]:
    """Write each cell's batch script (or one job array per process count, launcher.array) and submit it with
    sbatch unless this is a dry run; each cell's status keeps its job id (`exp status` shows it)."""
    groups: dict[tuple[int, ...], list[Job]] = {}
    for i, (folder, cell) in enumerate(jobs):
        world, shape = job_shape(folder, cell, how)
        key = (world, shape.nnodes) if how.slurm.array else (i,)
        groups.setdefault(key, []).append((folder, cell))
    outcomes = []
    for members in groups.values():
        world, shape = job_shape(*members[0], how)
        if how.slurm.array:
            script = matrix.slurm_array_script(world, shape.nnodes)
            name = f"{matrix.name}-{world}x{shape.nnodes}"
        else:
            script, name = members[0][0].slurm_script, members[0][1].dirname
        write_text(script, sbatch_script([f.path for f, _ in members], world, shape, job_name=name))
        outcomes += _sbatch(script, members, how.dry_run, array=how.slurm.array)
    return outcomes


def _sbatch(script, members: list[Job], dry_run: bool, array: bool) -> list[Outcome]:
    if dry_run:
        return [Outcome(cell, "written", f"wrote {script}") for _, cell in members]
    out = subprocess.run(["sbatch", "--parsable", str(script)], check=False, capture_output=True, text=True)
    if out.returncode != 0:
        for folder, _ in members:
            folder.write_status("failed", error=f"sbatch failed: {out.stderr.strip()}")
        return [Outcome(cell, "failed", out.stderr.strip()) for _, cell in members]
    job = out.stdout.strip().split(";")[0]  # --parsable: "id" or "id;cluster"
    outcomes = []
    for i, (folder, cell) in enumerate(members):
        task = f"{job}_{i}" if array else job
        folder.write_status("pending", slurm_job=task)
        outcomes.append(Outcome(cell, "submitted", f"slurm job {task}"))
    return outcomes


def queued(job: str | None) -> bool:
    """Whether SLURM still holds the job (pending, running, requeued): submitting the cell again would run it
    twice. Without squeue on PATH nothing is known: False."""
    if not job or shutil.which("squeue") is None:
        return False
    out = subprocess.run(["squeue", "--noheader", "--jobs", job, "--format=%T"], check=False, capture_output=True,
                         text=True)
    return out.returncode == 0 and bool(out.stdout.strip())
