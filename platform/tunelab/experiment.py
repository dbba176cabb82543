"""One `exp run`: a matrix file planned and checked, its cells run, its leaderboard and report written.

Everything a run can refuse is refused before the first file is written: the plan (matrix.load), the
selection (--only), the layout against the nodes, this machine (runtime.check_host), the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from tunelab import inputs, matrix, runner
from tunelab.errors import UserError
from tunelab.launch import Launch, procs_per_node
from tunelab.matrix import Cell, MatrixFile
from tunelab.matrixfolder import MatrixFolder
from tunelab.outcome import Outcome
from tunelab.store import make_dir


@dataclass(frozen=True)
class Request:
    file: Path
    sets: dict[str, Any] = field(default_factory=dict)  # --set KEY=VALUE, parsed
    only: str | None = None
    rerun_failed: bool = False
    fail_fast: bool = False
    runs_dir: Path = Path("runs")
    how: Launch = field(default_factory=Launch)
    slurm_flags: dict[str, Any] = field(default_factory=dict)  # --partition, --time, ... over launcher:


@dataclass
class Planned:
    spec: MatrixFile
    cells: list[Cell]  # every cell of the matrix
    chosen: list[Cell]  # the ones this run runs (--only)
    how: Launch
    runs_dir: Path

    @property
    def folder(self) -> MatrixFolder:
        return MatrixFolder(self.runs_dir / self.spec.name)


def plan(req: Request) -> Planned:
    """The cells to run, every check that can fail before a file is written done."""
    req.how.check()
    spec, cells = matrix.load(req.file, req.sets)
    how = replace(req.how, slurm=matrix.with_overrides(spec.launcher, req.slurm_flags))
    chosen = runner.select(cells, req.only)
    if not chosen:
        raise UserError(f"--only {req.only!r} matches none of the cells: {', '.join(c.slug for c in cells)}")
    for c in chosen:  # what cannot run here fails before anything is written
        procs_per_node(c.world_size, how)
        if how.launcher == "local":  # a SLURM job runs elsewhere: its machine is checked where it runs
            from tunelab.runtime import check_host

            check_host(c.config, file=req.file)
    offline = inputs.offline_problems([c.config for c in chosen]) if how.launcher == "local" else []
    if offline:
        raise UserError("; ".join(offline), file=req.file)
    from tunelab import services, tracking
    from tunelab.paths import cache_dir

    services.check_env()
    tracking.check_env()
    make_dir(cache_dir(), "the cache: $TUNELAB_CACHE, else ~/.cache/tunelab")
    make_dir(req.runs_dir / spec.name, "--runs-dir")
    return Planned(spec, cells, chosen, how, req.runs_dir)


def run(req: Request, planned: Planned, console: Console) -> list[Outcome]:
    """Run the chosen cells; node 0 writes the run's folder files first and the leaderboard and report after."""
    from tunelab.runview import view

    folder = planned.folder
    if planned.how.node_rank == 0:  # node 0 writes the run's folders; the other nodes only join its cells
        folder.write_matrix_file(req.file.read_text(), req.sets)
        folder.write_index(planned.cells)
    cells = planned.chosen
    with_view = view(console, planned.spec.name, len(cells))
    return runner.Runner(folder, with_view, planned.how, rerun_failed=req.rerun_failed,
                         fail_fast=req.fail_fast).run(cells)


def write_results(folder: MatrixFolder) -> Any:
    """The leaderboard files and the report page of a matrix's run folder -> the leaderboard (for printing)."""
    from tunelab.report import leaderboard
    from tunelab.report.html import page
    from tunelab.report.records import collect
    from tunelab.store import write_text

    board = leaderboard.write(folder.path)
    write_text(folder.report_file, page(folder.path, collect(folder.path)))
    return board
