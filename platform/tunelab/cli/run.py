"""`exp plan`, `exp run`, `exp status`, `exp clean`: a matrix from its file to its run folder."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from tunelab.cli import common
from tunelab.cli.common import RUN, Json, MatrixDir, RunsDir, Sets, app, err, human_bytes, out, print_json, print_wide

Workers = Annotated[int, typer.Option(min=1, help="cells side by side on this machine's CPUs, each pinned to its "
                                      "share with its threads sized to it (a GPU keeps one cell at a time)")]

RUN_EXAMPLE = """

Example: exp run experiments/tiny.yaml --set train.steps=3 --only 'adamw*'"""


def _plan_table(name: str, cells: list) -> Table:
    table = Table(title=f"{name}: {len(cells)} cells")
    keys = list(dict.fromkeys(k for c in cells for k in c.varying))
    scored = any(c.config.eval.checkpoints for c in cells)  # a column for scores along training
    for col in ("id", "cell", *keys, *(["checkpoints scored"] if scored else [])):
        table.add_column(col)
    for c in cells:
        table.add_row(c.id, c.slug, *(str(c.varying.get(k)) for k in keys), *([_along(c.config)] if scored else []))
    return table


def _say_warnings(spec, file: Path, cells: list, groups: list) -> None:
    """The plan's warnings (plan/warnings.py, a tune: section's): each once, with the cells or groups it concerns;
    nothing stops."""
    from tunelab.plan.warnings import cell_warnings
    from tunelab.tune import plan as tune_plan

    said: dict[str, list[str]] = {}
    for name, config in [*((c.slug, c.config) for c in cells), *((f"{g.slug} (search)", g.config) for g in groups)]:
        for w in cell_warnings(config):
            said.setdefault(w, []).append(name)
    lines = [f"{', '.join(names)}: {w}" for w, names in said.items()] + tune_plan.warnings(spec, file)
    for line in lines:
        err.print(f"[yellow]warning:[/] {escape(f'{file}: {line}')}", highlight=False, soft_wrap=True)


def _group_peaks(units: list, batched: bool) -> None:
    """Each together-group's peak by the memory model (`exp memory --together`), and its device's memory."""
    from tunelab.train.parallel import capacity

    for n, u in enumerate(units, 1):
        cfgs = [c.config for c in u.cells]
        peak = capacity.peak_mb(cfgs, batched)
        device = capacity.device_memory_mb(cfgs[0].train.device)
        said = f"predicted peak {peak:,.0f} MB (the memory model, tensors only)" if peak is not None else \
            f"peak not predicted (a method or optimizer the memory model does not cover: auto takes at most " \
            f"{capacity.FALLBACK} members)"
        out.print(f"[dim]together group {n}: {said}; {device:,.0f} MB on this machine's device", highlight=False,
                  soft_wrap=True)


def _joins(n: int, unit) -> dict:
    """A cell's part in the run's together-groups, for `exp plan --json`."""
    if unit.together:
        return {"group": n, "key": unit.key, "members": [c.slug for c in unit.cells]}
    return {"alone": unit.why}


def _along(cfg) -> str:
    """Which checkpoints a cell scores, and where: beside training or after it (eval.checkpoints.workers)."""
    ck, steps = cfg.eval.checkpoints, cfg.checkpoint_steps()
    if ck is None:
        return "-"
    shown = ",".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]},{steps[1]},...,{steps[-1]}"
    select = f"; final/ = best {cfg.train.select.metric}" if cfg.train.select else ""
    return f"steps {shown} ({len(steps)}): {ck.mode(_cuda(cfg.train.device))}{select}"


def _cuda(device: str) -> bool:
    """Whether a cell of train.device runs on CUDA on this machine (what `exp plan` says it will do here)."""
    if device != "auto":
        return device == "cuda"
    import torch

    return torch.cuda.is_available()


@app.command(rich_help_panel=RUN)
def plan(file: Annotated[Path, typer.Argument(help="matrix YAML")], sets: Sets = None, as_json: Json = False,
         runs_dir: RunsDir = Path("runs"),
         together: Annotated[str | None, typer.Option(help="as `exp run --together`: which cells would train in "
                                                           "one process")] = None,
         together_mode: Annotated[str | None, typer.Option(help="as `exp run --together-mode`")] = None) -> None:
    """Expand a matrix file and print its cells (and which train together); runs nothing."""
    from tunelab.core.errors import Errors
    from tunelab.experiment import ownership
    from tunelab.experiment.session import together_setting
    from tunelab.folders.matrix import MatrixFolder
    from tunelab.matrix import expansion
    from tunelab.matrix.sets import parse_sets
    from tunelab.run import together as joining
    from tunelab.run.groups import auto_cap
    from tunelab.tune import plan as tune_plan
    from tunelab.tune import show

    # What libraries print while the plan is made (a model built for the memory model: DeepSpeed's accelerator
    # line) goes to stderr: stdout is the plan (`--json` is read by programs).
    with contextlib.redirect_stdout(sys.stderr):
        overrides = parse_sets(sets or [])
        errors = Errors(file)  # every error of the file at once: its cells' and its searches' (tune.plan raises)
        spec, cells = expansion.load(file, overrides, errors)
        groups = tune_plan.groups(spec, file, overrides, errors)
        # The run folder this file would run in belongs to another file of its name: `exp run` would refuse it too.
        ownership.refuse(MatrixFolder(runs_dir / spec.name), file, file.read_text())
        setting = together_setting(together, together_mode, spec, file)
        units = joining.plan(cells, setting, cap_of=lambda cs: auto_cap(cs, setting.mode == "batched"))  # as exp run
        unit_of = {id(c): (n, u) for n, u in enumerate(units) for c in u.cells}
        from tunelab.plan.warnings import cell_warnings

        rows = [{"id": c.id, "eval_id": c.eval_id, "slug": c.slug, "varying": c.varying,
                 "checkpoints": c.checkpoints and {**c.checkpoints, "mode": _along(c.config)},
                 "together": _joins(*unit_of[id(c)]), "config": c.config.model_dump(mode="json"),
                 "warnings": cell_warnings(c.config)} for c in cells]
    if as_json:  # a matrix with searches: {"cells": [...], "groups": [...], "warnings": [...]}
        searches = [{**r, "warnings": cell_warnings(g.config)} for r, g in zip(show.plan_rows(groups), groups)]
        return print_json({"cells": rows, "groups": searches, "warnings": tune_plan.warnings(spec, file)}
                          if groups else rows)
    _say_warnings(spec, file, cells, groups)
    if cells or not groups:
        print_wide(_plan_table(spec.name, cells))
    if groups:
        print_wide(show.plan_table(spec.name, groups))
    for line in joining.describe(units, setting, groups):
        out.print(escape(line), highlight=False, soft_wrap=True)
    _group_peaks([u for u in units if u.together], setting.mode == "batched")
    from tunelab.matrix.input_checks import offline_problems
    from tunelab.plan.later import run_time_checks

    configs = [c.config for c in cells] + [g.config for g in groups]  # a search's trials are its group's cell
    for line in offline_problems(configs):
        err.print(f"[yellow]cannot run on this machine:[/] {escape(line)}", highlight=False, soft_wrap=True)
    for line in run_time_checks(configs):
        out.print(f"[dim]checked when the cells run: {escape(line)}", highlight=False, soft_wrap=True)


@app.command(rich_help_panel=RUN, help="Run every cell of a matrix (skipping done ones), then print and write the "
             "leaderboard." + RUN_EXAMPLE)
def run(
    file: Annotated[Path, typer.Argument(help="matrix YAML")],
    only: Annotated[str | None, typer.Option(help="run only cells whose slug or id matches this glob")] = None,
    rerun_failed: Annotated[bool, typer.Option(help="run cells that failed before again")] = False,
    fail_fast: Annotated[bool, typer.Option(help="stop at the first failed cell")] = False,
    runs_dir: RunsDir = Path("runs"),
    nnodes: Annotated[int, typer.Option(help="nodes a multi-process cell spans (torchrun rendezvous)")] = 1,
    node_rank: Annotated[int, typer.Option(help="this node's rank, 0..nnodes-1")] = 0,
    rdzv_endpoint: Annotated[str | None, typer.Option(help="HOST:PORT of the rendezvous, for --nnodes > 1")] = None,
    launcher: Annotated[str, typer.Option(help="local: run here; slurm: one sbatch job per cell (or job arrays)")
                        ] = "local",
    partition: Annotated[str | None, typer.Option(help="slurm: --partition (overrides launcher.partition)")] = None,
    time: Annotated[str | None, typer.Option(help="slurm: --time limit, e.g. 04:00:00 (overrides launcher.time)")
                    ] = None,
    account: Annotated[str | None, typer.Option(help="slurm: --account (overrides launcher.account)")] = None,
    qos: Annotated[str | None, typer.Option(help="slurm: --qos (overrides launcher.qos)")] = None,
    gpus_per_node: Annotated[int | None, typer.Option(help="slurm: --gpus-per-node (overrides the file's)")] = None,
    dry_run: Annotated[bool, typer.Option(help="slurm: write the sbatch scripts, do not submit")] = False,
    replace: Annotated[bool, typer.Option(help="make this file the matrix of a run folder that another file with "
                                               "the same name: ran in (its cell folders stay)")] = False,
    workers: Workers = 1,
    threads: common.Threads = None,
    together: Annotated[str | None, typer.Option(
        help="cells that share a frozen base train in one process: auto (as many as memory fits), off, or at most N "
             "members (overrides the file's run.together; docs/training.md)")] = None,
    together_mode: Annotated[str | None, typer.Option(
        help="exact: each member steps alone over the shared base, bit for bit the cell alone; batched: all "
             "members' rows in one pass through the base, each row through its own adapter (close to alone, not "
             "bit for bit; overrides the file's run.together_mode; docs/training.md)")
                             ] = None,
    sets: Sets = None,
) -> None:
    from tunelab.experiment import session
    from tunelab.matrix.sets import parse_sets
    from tunelab.run.launch import Launch

    flags = {"partition": partition, "time": time, "account": account, "qos": qos, "gpus_per_node": gpus_per_node}
    req = session.Request(
        file, parse_sets(sets or []), only, rerun_failed, fail_fast, runs_dir,
        Launch(nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, launcher=launcher, dry_run=dry_run),
        {k: v for k, v in flags.items() if v is not None}, replace=replace, workers=workers, threads=threads,
        together=together, together_mode=together_mode)
    planned = session.plan(req)
    _say_warnings(planned.spec, file, planned.chosen, planned.chosen_groups)
    outcomes = session.run(req, planned, err)
    if planned.how.launcher == "slurm":
        raise typer.Exit(1 if any(o.state == "failed" for o in outcomes) else 0)
    if planned.how.node_rank == 0:
        from tunelab.report import leaderboard

        board = session.write_results(planned.folder)
        print_wide(leaderboard.to_rich(board, f"{planned.spec.name} leaderboard"))
        mf = planned.folder
        out.print(f"wrote {mf.leaderboard_file('md')} (and .csv, .tex, .json) and the report {mf.report_file}")
    raise typer.Exit(_say_outcomes(planned, outcomes))


def _say_outcomes(planned, outcomes: list) -> int:
    """What needs the user's attention, and the exit code: failed and stopped cells, cells never started."""
    mdir = planned.folder
    failed = [o for o in outcomes if o.state in ("failed", "skipped-failed")]
    for o in failed:
        log = mdir.folder(o.cell).log_file
        err.print(f"[red]{o.cell.dirname} failed:[/] {escape(str(o.error))} (log: {log}; `exp status {mdir.path}` "
                  "shows its last lines)", soft_wrap=True)  # paths stay whole, to be copied
    if any(o.state == "skipped-failed" for o in failed):
        err.print("run again with --rerun-failed to retry failed cells")
    stopped = [o for o in outcomes if o.state == "interrupted"]
    for o in stopped:  # the cell's note says how it stopped, and often that a run resumes it
        why = str(o.error or "stopped")
        err.print(f"[yellow]{o.cell.dirname}[/]: {escape(why)}"
                  + ("" if "resume" in why else "; the same `exp run` resumes it"), soft_wrap=True)
    killed = [o for o in outcomes if o.state == "killed"]  # from outside, alone: not this run's signal (exit 1)
    for o in killed:
        err.print(f"[yellow]{o.cell.dirname} was killed[/] ({escape(str(o.error))}): `exp run` resumes it from its "
                  "last checkpoint", soft_wrap=True)
    for line in planned.waiting:  # a search that cannot take its next decision yet (tunelab.tune)
        err.print(f"[yellow]search {escape(line)}", soft_wrap=True)
    reached = {o.cell.id for o in outcomes}
    never = [c for c in planned.chosen if c.id not in reached]
    if never:
        err.print(f"[yellow]{len(never)} cell(s) not started[/] ({', '.join(c.slug for c in never)}): the same "
                  "`exp run` starts them", soft_wrap=True)
    if failed or killed or planned.waiting:
        return 1
    return 130 if stopped or never else 0


@app.command(rich_help_panel=RUN)
def status(matrix_dir: MatrixDir, as_json: Json = False) -> None:
    """Print the state of every cell of a matrix's run folder; why failed cells failed."""
    from tunelab.folders.cell import CellFolder
    from tunelab.folders.matrix import open_matrix
    from tunelab.report.status import STATE_NOTES, rows

    found = rows(open_matrix(matrix_dir, "status"))
    if as_json:
        return print_json(found)
    print_wide(_status_table(matrix_dir, found))
    for r in (r for r in found if r["state"] == "failed" and r["log_tail"]):
        out.print(f"[red]{escape(r['cell'])}[/]: last lines of {escape(str(CellFolder(Path(r['dir'])).log_file))}",
                  highlight=False)
        for line in r["log_tail"][-8:]:
            out.print(f"  {escape(line)}", highlight=False, soft_wrap=True)
    for r in (r for r in found if r["machine"]):  # why it is slow, with the figures (machine/load.py)
        out.print(f"[yellow]{escape(r['cell'])} slow[/]: {escape(r['machine'])}", highlight=False, soft_wrap=True)
    for state in dict.fromkeys(r["state"] for r in found):
        if state in STATE_NOTES:
            out.print(f"{state}: {STATE_NOTES[state]}", highlight=False)


def _status_table(matrix_dir: Path, found: list[dict]) -> Table:
    table = Table(title=str(matrix_dir))
    slurm = any(r["slurm_job"] for r in found)  # the job id column when the cells went to SLURM
    # Wall seconds of the attempts' stages (validation and checkpoints in training's): not the leaderboard's `train s`,
    # which is the steps alone.
    walls = ("train wall s", "eval wall s")
    for col in ("cell", "state", *(["slurm job"] if slurm else []), *walls, "disk", "cause / note"):
        table.add_column(col, justify="right" if col in (*walls, "disk") else "left")
    colors = {"done": "green", "failed": "red", "running": "yellow", "interrupted": "yellow", "pending": "dim"}
    for r in found:
        t = r["timings"]
        cause = "; ".join(dict.fromkeys(c for c in (r["error"], r["exit"], r["note"]) if c))
        table.add_row(r["cell"], f"[{colors.get(r['state'], 'white')}]{r['state']}",
                      *([r["slurm_job"] or "-"] if slurm else []),
                      f"{t['train_s']:.1f}" if "train_s" in t else "-",
                      f"{t['eval_s']:.1f}" if "eval_s" in t else "-", human_bytes(r["disk_bytes"]),
                      escape(cause))
    return table


@app.command(rich_help_panel=RUN)
def clean(
    root: Annotated[Path, typer.Argument(help="runs/, runs/<matrix>/ or one cell folder")],
    checkpoints: Annotated[bool, typer.Option("--checkpoints", help="delete checkpoints/ of done cells (the "
                                              "default when neither flag is given)")] = False,
    failed: Annotated[bool, typer.Option("--failed", help="delete failed cells' folders (they rerun from "
                                         "scratch)")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask for confirmation")] = False,
) -> None:
    """Free disk: show what would go and how much, ask, then delete. Locked (running) cells are left alone."""
    from tunelab.tools import clean as cleaning

    items = cleaning.plan(root, checkpoints=checkpoints or not failed, failed=failed)
    if not items:
        out.print("nothing to clean")
        return
    rows = [[escape(i.label), i.state, f"[dim]left alone: {i.skip}" if i.skip else
             ("checkpoints/" if i.target != i.cell.path else "the cell folder"), str(i.size), human_bytes(i.size)]
            for i in items]
    from tunelab.cli.common import table

    print_wide(table(f"exp clean {root}", ["cell", "state", "delete", "bytes", "size"], rows,
                     frozenset({"bytes", "size"})))
    todo = [i for i in items if not i.skip]
    total = sum(i.size for i in todo)
    if not todo:
        out.print("nothing to clean: every match is locked")
        return
    out.print(f"{len(todo)} deletion(s), {total} bytes ({human_bytes(total)})", highlight=False)
    if not yes and not typer.confirm("delete?", default=False):
        err.print("nothing deleted")
        raise typer.Exit(1)
    done = [i for i in todo if cleaning.delete(i)]
    for i in todo:
        if i not in done:
            err.print(f"{escape(i.label)}: left alone, it was locked or changed state meanwhile", highlight=False)
    cleaning.refresh_leaderboards(done)
    freed = sum(i.size for i in done)
    out.print(f"freed {freed} bytes ({human_bytes(freed)})", highlight=False)
