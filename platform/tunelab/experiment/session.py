"""One `exp run`: a matrix file planned and checked, its cells run, its leaderboard and report written.

Everything a run can refuse is refused before the first file is written: the plan (expansion.load), the
selection (--only), the layout against the nodes, this machine (runtime.check_host), the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from tunelab.core.config import world_size
from tunelab.core.errors import Errors, UserError
from tunelab.core.files import make_dir
from tunelab.experiment import ownership
from tunelab.folders.matrix import MatrixFolder
from tunelab.matrix import expansion, input_checks, launcher
from tunelab.matrix.expansion import Cell
from tunelab.matrix.schema import MatrixFile
from tunelab.run import runner
from tunelab.run.launch import Launch, procs_per_node
from tunelab.run.outcome import Outcome
from tunelab.run.together import Setting

if TYPE_CHECKING:
    from tunelab.machine.threads import Share
    from tunelab.tune.plan import Group


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
    replace: bool = False  # --replace: this file takes over a run folder another file of its name ran in
    workers: int = 1  # --workers: cells side by side on this machine
    threads: int | None = None  # --threads: each cell process's torch threads (None: sized to its share)
    together: str | None = None  # --together, over the file's run.together
    together_mode: str | None = None  # --together-mode


@dataclass
class Planned:
    spec: MatrixFile
    cells: list[Cell]  # every cell of the matrix
    chosen: list[Cell]  # the ones this run runs (--only)
    how: Launch
    runs_dir: Path
    together: Setting = field(default_factory=Setting)  # together-groups (run/together.py)
    groups: list[Group] = field(default_factory=list)  # every method group of a tune: section (tunelab.tune)
    chosen_groups: list[Group] = field(default_factory=list)  # the ones this run searches (--only)
    waiting: list[str] = field(default_factory=list)  # after run: searches that cannot go on yet, and why
    shares: tuple[Share, ...] = ()  # the threads and CPUs of each cell run at once (machine/threads.py)
    notes: list[str] = field(default_factory=list)  # said before the cells start

    @property
    def folder(self) -> MatrixFolder:
        return MatrixFolder(self.runs_dir / self.spec.name)


def plan(req: Request) -> Planned:
    """The cells to run, every check that can fail before a file is written done."""
    req.how.check()
    errors = Errors(req.file)  # every error of the file at once: its cells' and its searches' (tune.plan raises)
    spec, cells = expansion.load(req.file, req.sets, errors)
    setting = together_setting(req.together, req.together_mode, spec, req.file)
    how = replace(req.how, slurm=launcher.with_overrides(spec.launcher, req.slurm_flags))
    groups, chosen_groups = _searches(spec, req, how, errors)
    chosen = runner.select(cells, req.only)
    if not chosen and not chosen_groups:
        names = [c.slug for c in cells] + [f"{g.slug} (a search)" for g in groups]
        raise UserError(f"--only {req.only!r} matches none of the cells: {', '.join(names)}")
    configs = [c.config for c in chosen] + [g.config for g in chosen_groups]
    for config in configs:  # what cannot run here fails before anything is written
        procs_per_node(world_size(config.parallel), how)
        if how.launcher == "local":  # a SLURM job runs elsewhere: its machine is checked where it runs
            from tunelab.machine.runtime import check_host

            check_host(config, file=req.file)
    offline = input_checks.offline_problems(configs) if how.launcher == "local" else []
    if offline:
        raise UserError("; ".join(offline), file=req.file)
    from tunelab.core import hub_access
    from tunelab.core.paths import cache_dir
    from tunelab.data.tokenize import num_proc_env
    from tunelab.report import tracking
    from tunelab.run.progress import every_s

    hub_access.check_env()
    tracking.check_env()
    num_proc_env(), every_s()  # read by the cells and the progress lines: refused now, before anything is written
    make_dir(cache_dir(), "the cache: $TUNELAB_CACHE, else ~/.cache/tunelab")
    shares, notes = _shares(req, how, configs)
    if len(shares) > 1 and not setting.off:  # a group is one process: side by side, each cell runs alone
        if req.together is not None:
            raise UserError(f"--workers {req.workers} and --together {req.together}: cells side by side run "
                            "each in its own process, and a together-group is one process; choose one "
                            "(--together off, or --workers 1)", file=req.file)
        notes.append(f"--workers {req.workers}: each cell in its own process (together-groups are off)")
        setting = Setting("off", setting.mode)
    make_dir(req.runs_dir / spec.name, "--runs-dir")
    if not req.replace:  # a run folder of another file with this name (experiment/ownership.py)
        ownership.refuse(MatrixFolder(req.runs_dir / spec.name), req.file, req.file.read_text())
    return Planned(spec, cells, chosen, how, req.runs_dir, together=setting, groups=groups,
                   chosen_groups=chosen_groups, shares=shares, notes=notes)


def together_setting(together: str | None, mode: str | None, spec: MatrixFile, file: Path) -> Setting:
    """--together over the file's `run.together` (and the modes likewise); a refused value is exit 2, named where it
    was given (the flag, or the file's key with the file)."""
    flag = (together is not None, mode is not None)
    names = ("--together" if flag[0] else "run.together", "--together-mode" if flag[1] else "run.together_mode")
    try:
        return Setting.parse(together if flag[0] else spec.run.together, mode if flag[1] else spec.run.together_mode,
                             names)
    except UserError as e:
        in_file = str(e).startswith("run.")
        raise UserError(str(e), file=file if in_file else None) from None


def _shares(req: Request, how: Launch, configs: list) -> tuple[tuple[Share, ...], list[str]]:
    """--workers and --threads against where the cells run: several cells at once on this machine's CPUs only
    (a GPU keeps one cell per device set); the user's OMP_NUM_THREADS checked here, before anything is written."""
    from tunelab.machine.threads import shares

    if req.workers > 1 and (how.launcher != "local" or how.nnodes > 1):
        raise UserError(f"--workers {req.workers} runs cells side by side on this machine: not with --launcher "
                        f"{how.launcher}, --nnodes {how.nnodes} (each SLURM job or node runs one cell at a time)")
    workers, notes = req.workers, []
    if workers > 1:
        from tunelab.machine.runtime import device_of

        gpu = [c for c in configs if device_of(c.train.device).type != "cpu"]
        if gpu:
            workers = 1
            notes.append(f"--workers {req.workers}: the cells train on {device_of(gpu[0].train.device)}, one cell at "
                         "a time (a GPU machine keeps one cell per device set)")
    return tuple(shares(workers, req.threads)), notes


def _searches(spec: MatrixFile, req: Request, how: Launch, errors: Errors) -> tuple[list[Group], list[Group]]:
    """The method groups of the file's tune: sections, and those --only chooses (docs/tuning.md)."""
    from tunelab.tune import plan as tune_plan

    groups = tune_plan.groups(spec, req.file, req.sets, errors)
    chosen = tune_plan.select(groups, req.only)
    if chosen and (how.launcher != "local" or how.nnodes > 1):
        raise UserError("a matrix with a tune: section runs its searches with the local launcher on one node per "
                        "runner (each rung needs the one before it): on a cluster, run `exp run FILE` in one job per "
                        "node on a shared runs folder; they share the trials (docs/tuning.md)")
    from tunelab.tune.record import check_reachable

    for url in {g.spec.storage for g in chosen} - {"journal"}:  # a server that cannot be reached: before training
        check_reachable(url)  # (the journal file is the runs folder's own, made when the search starts)
    return groups, chosen


def run(req: Request, planned: Planned, console: Console) -> list[Outcome]:
    """Run the chosen cells; node 0 writes the run's folder files first and the leaderboard and report after."""
    from tunelab.run.progress import view

    for note in planned.notes:
        console.print(f"[yellow]{note}", highlight=False, soft_wrap=True)
    folder = planned.folder
    if planned.how.node_rank == 0:  # node 0 writes the run's folders; the other nodes only join its cells
        text = req.file.read_text()
        ownership.claim(folder, req.file, text, req.replace, lambda line: console.print(line, highlight=False))
        folder.write_matrix_file(text, req.sets)
        if not planned.groups:  # a search writes its own (its winners join it as they are found)
            folder.write_index(planned.cells)
    if planned.groups:
        from tunelab.tune import driver

        result = driver.run(planned.groups, planned.chosen_groups, planned.cells, planned.chosen, folder,
                            console=console, how=planned.how, rerun_failed=req.rerun_failed, fail_fast=req.fail_fast,
                            shares=planned.shares, together=planned.together)
        planned.waiting = result.waiting
        return result.outcomes
    cells = planned.chosen
    with_view = view(console, planned.spec.name, len(cells))
    return runner.Runner(folder, with_view, planned.how, rerun_failed=req.rerun_failed,
                         fail_fast=req.fail_fast, shares=planned.shares, together=planned.together).run(cells)


def write_results(folder: MatrixFolder) -> Any:
    """The leaderboard files and the report page of a matrix's run folder -> the leaderboard (for printing)."""
    from tunelab.core.files import write_text
    from tunelab.report import leaderboard
    from tunelab.report.html import page
    from tunelab.report.records import collect

    board = leaderboard.write(folder.path)
    write_text(folder.report_file, page(folder.path, collect(folder.path)))
    return board
