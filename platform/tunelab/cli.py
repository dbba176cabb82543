"""`exp`: the command line. Bad input ends in one paragraph on stderr and exit code 2."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tunelab.errors import UserError

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},  # subcommands inherit it
                  help="tunelab: instruction-tuning experiment matrices, trained, evaluated and tabulated.")
out = Console()  # rich honours NO_COLOR (and FORCE_COLOR, TERM=dumb) from the environment
err = Console(stderr=True)


def _print_version(value: bool) -> None:
    if value:
        from tunelab import __version__

        print(f"tunelab {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="print tunelab's version and exit")] = False,
) -> None:
    pass

RunsDir = Annotated[Path, typer.Option("--runs-dir", help="where runs/<matrix>/<cell>/ folders go")]
Json = Annotated[bool, typer.Option("--json", help="print JSON for programs instead of a table")]
Sets = Annotated[list[str] | None, typer.Option("--set", help="KEY=VALUE for every cell, over the file's own "
                                                "values (repeatable): --set model.name=tiny-random-llama")]
# `exp --help` lists commands by what a user does.
RUN, INSPECT, EVALUATE, EXPORT = "Run", "Inspect", "Evaluate", "Export"


def _print_json(obj) -> None:
    import json

    print(json.dumps(obj, indent=2, default=str))


def _print_wide(table: Table) -> None:
    """A terminal's width is respected; a pipe or log file has none, so tables are not squeezed there."""
    (out if out.is_terminal else Console(width=200)).print(table)


def _plan_table(name: str, cells) -> Table:
    table = Table(title=f"{name}: {len(cells)} cells")
    keys = list(dict.fromkeys(k for c in cells for k in c.varying))
    for col in ("id", "cell", *keys):
        table.add_column(col)
    for c in cells:
        table.add_row(c.id, c.slug, *(str(c.varying.get(k)) for k in keys))
    return table


@app.command(rich_help_panel=RUN)
def plan(file: Annotated[Path, typer.Argument(help="matrix YAML")], sets: Sets = None, as_json: Json = False) -> None:
    """Expand a matrix file and print its cells; runs nothing."""
    from tunelab import matrix

    spec, cells = matrix.load(file, matrix.parse_sets(sets or []))
    if as_json:
        return _print_json([{"id": c.id, "eval_id": c.eval_id, "slug": c.slug, "varying": c.varying,
                             "config": c.config.model_dump(mode="json")} for c in cells])
    _print_wide(_plan_table(spec.name, cells))


@app.command(rich_help_panel=RUN)
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
    sets: Sets = None,
) -> None:
    """Run every cell of a matrix (skipping done ones), then print and write the leaderboard."""
    from dataclasses import replace

    from tunelab import matrix, runner
    from tunelab.launch import Launch, procs_per_node
    from tunelab.report import leaderboard
    from tunelab.store import make_dir, write_text

    how = Launch(nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, launcher=launcher,
                 dry_run=dry_run)
    how.check()
    overrides = matrix.parse_sets(sets or [])
    spec, cells = matrix.load(file, overrides)
    flags = {"partition": partition, "time": time, "account": account, "qos": qos, "gpus_per_node": gpus_per_node}
    how = replace(how, slurm=matrix.with_overrides(spec.launcher, {k: v for k, v in flags.items() if v is not None}))
    chosen = runner.select(cells, only)
    if not chosen:
        raise UserError(f"--only {only!r} matches none of the cells: {', '.join(c.slug for c in cells)}")
    for c in chosen:  # what cannot run here fails before anything is written
        procs_per_node(runner.world_size(c), how)
        if how.launcher == "local":  # a SLURM job runs elsewhere: its machine is checked where it runs
            from tunelab.runtime import check_host

            check_host(c.config, file=file)
    from tunelab import services, tracking
    from tunelab.paths import cache_dir

    services.check_env()
    tracking.check_env()
    make_dir(cache_dir(), "the cache: $TUNELAB_CACHE, else ~/.cache/tunelab")
    mdir = runs_dir / spec.name
    make_dir(mdir, "--runs-dir")
    if how.node_rank == 0:  # node 0 writes the run's folders; the other nodes only join its cells' processes
        # The file as run; --set overrides are written on top, so the folder says how its cells were made.
        header = "".join(f"# exp run --set {k}={v}\n" for k, v in overrides.items())
        write_text(mdir / "matrix.yaml", header + file.read_text())
        runner.write_index(mdir, cells)
    outcomes = runner.run_cells(chosen, spec.name, runs_dir, rerun_failed=rerun_failed, fail_fast=fail_fast,
                                console=err, how=how)
    if how.launcher == "slurm":
        raise typer.Exit(1 if any(o.state == "failed" for o in outcomes) else 0)
    if how.node_rank == 0:
        board = leaderboard.write(mdir)
        _print_wide(leaderboard.to_rich(board, f"{spec.name} leaderboard"))
        from tunelab.report.html import page
        from tunelab.report.records import collect as records

        write_text(mdir / "report.html", page(mdir, records(mdir)))
        out.print(f"wrote {mdir / 'leaderboard.md'} (and .csv, .tex, .json) and the report {mdir / 'report.html'}")
    failed = [o for o in outcomes if o.state in ("failed", "skipped-failed")]
    for o in failed:
        log = runner.cell_dir(mdir, o.cell) / "cell.log"
        err.print(f"[red]{o.cell.dirname} failed:[/] {escape(str(o.error))} (log: {log}; `exp status {mdir}` shows "
                  "its last lines)", soft_wrap=True)  # paths stay whole, to be copied
    if any(o.state == "skipped-failed" for o in failed):
        err.print("run again with --rerun-failed to retry failed cells")
    stopped = [o for o in outcomes if o.state == "interrupted"]
    for o in stopped:
        err.print(f"[yellow]{o.cell.dirname} was interrupted[/] ({escape(str(o.error))}): run again to resume it",
                  soft_wrap=True)
    raise typer.Exit(1 if failed or stopped else 0)


def _status_rows(matrix_dir: Path) -> list[dict]:
    from tunelab.cellfolder import disk_usage
    from tunelab.store import cell_dirs, live_state, read_json, read_status

    rows = []
    for d in cell_dirs(matrix_dir):
        st, meta = read_status(d), read_json(d / "cell.json") or {}
        rows.append({"cell": meta.get("slug", d.name), "id": meta.get("id"), "dir": str(d),
                     "state": live_state(d, st), "timings": st.get("timings") or {},
                     "disk_bytes": disk_usage(d), "error": st.get("error"), "exit": st.get("exit"),
                     "log_tail": st.get("log_tail") or [], "slurm_job": st.get("slurm_job"), "note": st.get("note")})
    return rows


STATE_NOTES = {
    "interrupted": "its status says running, but no process holds its folder's lock: it died without a word "
                   "(killed, out of memory, machine lost); `exp run` resumes it from its last checkpoint",
    "failed": "`exp run --rerun-failed` retries failed cells; the whole log is the cell folder's cell.log",
}


@app.command(rich_help_panel=RUN)
def status(matrix_dir: Annotated[Path, typer.Argument(help="runs/<matrix> folder")], as_json: Json = False) -> None:
    """Print the state of every cell of a matrix's run folder; why failed cells failed."""
    from tunelab.cellfolder import human_bytes

    if not matrix_dir.is_dir():
        raise UserError("no such run folder", file=matrix_dir)
    rows = _status_rows(matrix_dir)
    if as_json:
        return _print_json(rows)
    table = Table(title=str(matrix_dir))
    slurm = any(r["slurm_job"] for r in rows)  # the job id column when the cells went to SLURM
    for col in ("cell", "state", *(["slurm job"] if slurm else []), "train s", "eval s", "disk", "cause / note"):
        table.add_column(col)
    colors = {"done": "green", "failed": "red", "running": "yellow", "interrupted": "yellow", "pending": "dim"}
    for r in rows:
        t = r["timings"]
        cause = "; ".join(dict.fromkeys(c for c in (r["error"], r["exit"], r["note"]) if c))
        table.add_row(r["cell"], f"[{colors.get(r['state'], 'white')}]{r['state']}",
                      *([r["slurm_job"] or "-"] if slurm else []),
                      f"{t['train_s']:.0f}" if "train_s" in t else "-",
                      f"{t['eval_s']:.0f}" if "eval_s" in t else "-", human_bytes(r["disk_bytes"]),
                      escape(cause[:160]))
    _print_wide(table)
    for r in (r for r in rows if r["state"] == "failed" and r["log_tail"]):
        out.print(f"[red]{escape(r['cell'])}[/]: last lines of {escape(r['dir'])}/cell.log", highlight=False)
        for line in r["log_tail"][-8:]:
            out.print(f"  {escape(line)}", highlight=False, soft_wrap=True)
    for state in dict.fromkeys(r["state"] for r in rows):
        if state in STATE_NOTES:
            out.print(f"{state}: {STATE_NOTES[state]}", highlight=False)


def _where(pairs: list[str]) -> dict[str, str]:
    out = {}
    for p in pairs:
        key, eq, value = p.partition("=")
        if not eq or not key:
            raise UserError(f"--where {p!r}: expected KEY=VALUE with a dotted config key, e.g. optim.name=adamw")
        out[key] = value
    return out


@app.command("leaderboard", rich_help_panel=INSPECT)
def leaderboard_cmd(
    matrix_dir: Annotated[Path, typer.Argument(help="runs/<matrix> folder")],
    fmt: Annotated[str | None, typer.Option("--format", help="md, csv, latex, html or json to stdout "
                                            "(default: a table for the terminal)")] = None,
    aggregate: Annotated[bool, typer.Option(help="fold train.seed: one row per configuration, mean ± std "
                                            "over its seeds")] = True,
    by: Annotated[str | None, typer.Option(help="comma-separated keys the rows are grouped by; everything "
                                           "else is folded (e.g. optim.name)")] = None,
    where: Annotated[list[str] | None, typer.Option(help="only cells whose KEY=VALUE (repeatable)")] = None,
    sort: Annotated[str | None, typer.Option(help="column to sort by, best first ('-COLUMN' reverses)")] = None,
    as_json: Json = False,
) -> None:
    """Rebuild the leaderboard files of a matrix's run folder and print it (seeds folded, best values bold)."""
    from tunelab.report import leaderboard
    from tunelab.report.records import collect
    from tunelab.report.table import build

    if not matrix_dir.is_dir():
        raise UserError("no such run folder", file=matrix_dir)
    fmt = "json" if as_json else fmt
    if fmt is not None and fmt not in leaderboard.FORMATS:
        raise UserError(f"--format {fmt!r}: allowed are {', '.join(leaderboard.FORMATS)}")
    leaderboard.write(matrix_dir)  # the files keep the default view
    board = build(collect(matrix_dir), aggregate=aggregate, by=by.split(",") if by else None,
                  where=_where(where or []), sort=sort)
    title = f"{matrix_dir.name} leaderboard"
    if fmt is None:
        return _print_wide(leaderboard.to_rich(board, title))
    print(leaderboard.render(board, fmt, title), end="")


@app.command("ls", rich_help_panel=INSPECT)
def ls(kind: Annotated[str | None, typer.Argument(help="models, recipes, suites, tasks, optimizers, peft or "
                                                  "experiments; all of them when left out")] = None,
       as_json: Json = False,
       everything: Annotated[bool, typer.Option("--all", help="tasks: also every task and group of lm-eval, with "
                                                "its output type")] = False) -> None:
    """List what a matrix can name, one line each: registered names and the content folders' files."""
    from tunelab.listing import KINDS, rows

    if kind is not None and kind not in KINDS:
        raise UserError(f"exp ls {kind!r}: allowed are {', '.join(KINDS)}")
    kinds = [kind] if kind else list(KINDS)
    if as_json:
        return _print_json({k: dict(rows(k, everything)) for k in kinds})
    for k in kinds:
        table = Table(title=k, title_justify="left")
        table.add_column("name")
        table.add_column("what")
        for name, what in rows(k, everything):
            table.add_row(name, what)
        _print_wide(table)


@app.command(rich_help_panel=INSPECT)
def models(as_json: Json = False) -> None:
    """List the model catalog's aliases (the same as `exp ls models`)."""
    ls("models", as_json)


def _add_subcommands() -> None:
    """Stage CLIs live beside their stage (`exp data ...`, `exp eval ...`)."""
    from tunelab.data.cli import app as data_app
    from tunelab.evals.cli import app as eval_app

    app.add_typer(data_app, name="data", help="Build, inspect and preview data recipes.", rich_help_panel=INSPECT)
    app.add_typer(eval_app, name="eval", help="Evaluate any model on a suite; fetch offline eval data.",
                  rich_help_panel=EVALUATE)
    from tunelab.train.parallel.cli import memory

    app.command("memory", rich_help_panel=INSPECT)(memory)
    from tunelab.report.compare_cli import compare_cmd
    from tunelab.report.report_cli import report_cmd

    app.command("compare", rich_help_panel=INSPECT)(compare_cmd)
    app.command("report", rich_help_panel=INSPECT)(report_cmd)
    from tunelab.everyday_cli import chat_cmd, clean_cmd, export_cmd

    app.command("chat", rich_help_panel=EVALUATE)(chat_cmd)
    app.command("clean", rich_help_panel=RUN)(clean_cmd)
    app.command("export", rich_help_panel=EXPORT)(export_cmd)


_add_subcommands()


def main() -> None:
    try:
        app()
    except UserError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:  # the cell marks itself pending; its checkpoints stay
        err.print("interrupted: run the same `exp run` again to continue (cells resume from their checkpoints)")
        sys.exit(130)


if __name__ == "__main__":
    main()
