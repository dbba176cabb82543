"""`exp leaderboard`, `exp compare`, `exp report`: the results of a matrix's run folder."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tunelab.cli.common import INSPECT, Json, MatrixDir, RunsDir, app, out, print_json, print_wide
from tunelab.core.errors import UserError
from tunelab.report.compare import Comparison, state_of
from tunelab.report.scores import MARKS, fmt, marked


def _where(pairs: list[str]) -> dict[str, str]:
    found = {}
    for p in pairs:
        key, eq, value = p.partition("=")
        if not eq or not key:
            raise UserError(f"--where {p!r}: expected KEY=VALUE with a dotted config key, e.g. optim.name=adamw")
        found[key] = value
    return found


@app.command("leaderboard", rich_help_panel=INSPECT, help="Rebuild the leaderboard files of a matrix's run folder and "
             "print it (seeds folded, best values bold).\n\nExample: exp leaderboard runs/quickstart --by optim.name "
             "--where peft.method=none --sort -mmlu")
def leaderboard_cmd(
    matrix_dir: MatrixDir,
    fmt_: Annotated[str | None, typer.Option("--format", help="md, csv, latex, html or json to stdout "
                                             "(default: a table for the terminal)")] = None,
    aggregate: Annotated[bool, typer.Option(help="fold train.seed: one row per configuration, mean ± std "
                                            "over its seeds")] = True,
    by: Annotated[str | None, typer.Option(help="comma-separated keys the rows are grouped by; everything "
                                           "else is folded (e.g. optim.name)")] = None,
    where: Annotated[list[str] | None, typer.Option(help="only cells whose KEY=VALUE (repeatable)")] = None,
    sort: Annotated[str | None, typer.Option(help="column to sort by, best first ('-COLUMN' reverses)")] = None,
    at_step: Annotated[int | None, typer.Option("--at-step", min=1, help="the scores of each cell's checkpoint of "
                                                "step N (eval.checkpoints) instead of its final evaluation")] = None,
    best: Annotated[bool, typer.Option("--best", help="the scores of the checkpoint train.select made final/ (a "
                                       "cell without a selection: its last step's)")] = False,
    every: Annotated[bool, typer.Option("--all", help="every cell folder of the run folder, also those the matrix "
                                        "as last run does not list (earlier runs with other --set values)")] = False,
    as_json: Json = False,
) -> None:
    from tunelab.folders.matrix import open_matrix
    from tunelab.report import leaderboard
    from tunelab.report.records import collect, left_out_notes
    from tunelab.report.table import build

    folder = open_matrix(matrix_dir, "leaderboard")
    fmt_ = "json" if as_json else fmt_
    if fmt_ is not None and fmt_ not in leaderboard.FORMATS:
        raise UserError(f"--format {fmt_!r}: allowed are {', '.join(leaderboard.FORMATS)}")
    if best and at_step is not None:
        raise UserError("--at-step and --best each choose the checkpoint a row shows: give one of them")
    records = collect(folder.path, "best" if best else at_step, every=every)
    if best and not any(r.curve for r in records):
        raise UserError("--best: no cell of this matrix has scores of its checkpoints (eval.checkpoints scores "
                        "them, train.select chooses one); without them the rows are the final evaluation: leave out "
                        "--best", file=folder.path)
    if at_step is not None and not any(r.scores for r in records):
        scored = sorted({s for r in records for s in r.curve})
        raise UserError(f"--at-step {at_step}: no cell has scores of a checkpoint of that step; scored steps: "
                        f"{', '.join(map(str, scored)) or 'none (eval.checkpoints scores checkpoints)'}")
    board = build(records, aggregate=aggregate, by=by.split(",") if by else None, where=_where(where or []),
                  sort=sort, notes=[] if every else left_out_notes(folder.path))
    leaderboard.write(folder.path)  # the files keep the default view; written once the options proved sound
    title = f"{folder.name} leaderboard" + (f" at step {at_step}" if at_step else " at the selected checkpoints"
                                            if best else "")
    if fmt_ is None:
        print_wide(leaderboard.to_rich(board, title))
        if not board.rows:
            _say_empty(folder)
        return
    print(leaderboard.render(board, fmt_, title), end="")


def _say_empty(folder) -> None:
    """A board with no row: why, and where to look (a search stopped before its winner, cells not run yet)."""
    searches = folder.studies_file.is_file()
    out.print(f"no results yet: no cell of {folder.path} has finished"
              + (" and no search has chosen its winner" if searches else "")
              + f"; `exp status {folder.path}` shows each cell's state"
              + (f", `exp tune status {folder.path}` each search's trials" if searches else "")
              + "; `exp run` the matrix file again to go on", highlight=False, soft_wrap=True)


def _pct(p: float | None) -> str:
    return "-" if p is None else (f"{p:.3g}" if p >= 1e-4 else "<1e-4")


def _show(c: Comparison) -> None:
    out.print(f"[bold]A[/] {c.a.dir} ({state_of(c.a)})\n[bold]B[/] {c.b.dir} ({state_of(c.b)})", soft_wrap=True)
    table = Table(title="config: what differs", title_justify="left")
    for col in ("key", "A", "B"):
        table.add_column(col)
    for k, (va, vb) in c.config_diff.items():
        table.add_row(k, fmt(va), fmt(vb))
    print_wide(table) if c.config_diff else out.print("config: identical")
    table = Table(title="scores: B - A, paired over the same items", title_justify="left")
    for col in ("task", "A", "B", "B - A", "95% CI", "p", "test", "items"):
        table.add_column(col, justify="left" if col in ("task", "test") else "right")
    for t in c.tasks:
        r = t.result
        sides = [marked(s.value, s.subset, not s.ok) if s else "-" for s in t.scores]
        if r is None:
            va, vb = t.values
            # a difference only over the same items: not when the sides scored different ones
            both = isinstance(va, (int, float)) and isinstance(vb, (int, float)) and "different items" not in t.refused
            table.add_row(t.task, *sides, f"{vb - va:+.4g}" if both else "", "", "", f"no test: {t.refused}",
                          " / ".join(str(s.n) if s else "-" for s in t.scores))
        else:
            table.add_row(t.task, *sides, f"{r.diff:+.4g}", f"[{r.ci[0]:+.3g}, {r.ci[1]:+.3g}]",
                          _pct(r.p), r.test, str(r.n))
    print_wide(table)
    out.print(MARKS, soft_wrap=True, highlight=False, markup=False)
    table = Table(title="training", title_justify="left")
    for col in ("figure", "A", "B", "B - A", "B / A"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for name, (va, vb) in c.figures.items():
        both = isinstance(va, (int, float)) and isinstance(vb, (int, float))
        table.add_row(name, fmt(va), fmt(vb), f"{vb - va:+.4g}" if both else "-",
                      f"{vb / va:.3g}x" if both and va else "-")
    print_wide(table)


def _as_json(c: Comparison) -> dict:
    return {"a": str(c.a.dir), "b": str(c.b.dir), "states": [state_of(c.a), state_of(c.b)],
            "config_diff": c.config_diff, "figures": c.figures,
            "tasks": [{"task": t.task, "refused": t.refused or None, "values": t.values,
                       "marks": [{"subset": s.subset, "unavailable": not s.ok, "stand_in": s.stand_in, "n": s.n}
                                 if s else None for s in t.scores],
                       **({**asdict(t.result), "p": t.result.p, "test": t.result.test} if t.result else {})}
                      for t in c.tasks]}



def _named(arg: Path, runs_dir: Path) -> Path:
    """A cell, a leaderboard row (runs/<matrix>/<label>: report.compare.pairs reads its cells from cells.json) or a
    matrix, however the user names it (folders.targets)."""
    from tunelab.folders.targets import resolve

    target = resolve(str(arg), "compare", ("cell", "row", "matrix"), runs_dir)
    assert target.path is not None
    return target.cell.path if target.kind == "cell" else target.path


@app.command("compare", rich_help_panel=INSPECT, help="Compare two cells (or two matrices, cell by cell): config, "
             "scores with paired significance tests (McNemar, paired bootstrap), training loss, memory and speed."
             " Two leaderboard rows (runs/<matrix>/<label>, e.g. two tuned groups) are paired seed by seed."
             "\n\nExample: exp compare runs/quickstart/adamw-none runs/quickstart/adamw-lora")
def compare_cmd(
    a: Annotated[Path, typer.Argument(help="a cell (folder, or the name the leaderboard prints) or a matrix's run "
                                           "folder")],
    b: Annotated[Path, typer.Argument(help="the other cell, leaderboard row (runs/<matrix>/adamw-tuned) or matrix")],
    resamples: Annotated[int, typer.Option(help="paired bootstrap resamples")] = 10_000,
    seed: Annotated[int, typer.Option(help="seed of the bootstrap")] = 0,
    runs_dir: RunsDir = Path("runs"),
    as_json: Json = False,
) -> None:
    from tunelab.report.compare import compare_cells, pairs, rankings

    a, b = (_named(x, runs_dir) for x in (a, b))
    if resamples < 100:
        raise UserError(f"--resamples {resamples}: use at least 100 (the p-values are counts over resamples)")
    results = [compare_cells(x, y, resamples, seed) for x, y in pairs(a, b)]
    ranked = rankings(a, b, resamples, seed)  # two tuned rows: their studies and seeds drawn again
    if as_json:
        return print_json([{**_as_json(c), **({"rankings": [asdict(r) for r in ranked]} if ranked else {})}
                           for c in results])
    for c in results:
        _show(c)
    if ranked:
        _show_rankings(ranked, resamples, seed)


def _show_rankings(ranked: list, resamples: int, seed: int) -> None:
    table = Table(title=f"ranking: how often A ranks above B when its studies and seeds are drawn again (paired "
                        f"bootstrap, {resamples} draws, seed {seed})", title_justify="left")
    for col in ("task", "A", "B", "A above B", "studies", "seeds"):
        table.add_column(col, justify="left" if col == "task" else "right")
    for r in ranked:
        table.add_row(r.task, fmt(r.a), fmt(r.b), f"{r.above:.1%}", str(r.studies), str(r.seeds))
    out.print(table)
    out.print("A and B: the median over studies of each study's winner (the mean over its seeds); one study and "
              "one seed leave nothing to draw again (the share is then 0%, 50% or 100%).", soft_wrap=True)


def check_out(out: Path) -> None:
    """--out must name a file in a folder this process can write (made if missing, under a writable one)."""
    if out.is_dir():
        raise UserError("--out names a folder; give a file name such as report.html", file=out)
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"--out cannot be written: {parent} is a file, not a folder", file=out)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--out cannot be written: no permission to write in {parent}", file=out)



@app.command("report", rich_help_panel=INSPECT)
def report_cmd(
    matrix_dir: MatrixDir,
    out_file: Annotated[Path | None, typer.Option("--out", help="the HTML file to write (default: DIR/report.html)")]
    = None,
) -> None:
    """Write one self-contained HTML page of a matrix's results: leaderboard, loss curves, memory and speed
    bars, and the provenance of every score."""
    from tunelab.core.files import write_text
    from tunelab.folders.matrix import open_matrix
    from tunelab.report.html import page
    from tunelab.report.records import collect

    folder = open_matrix(matrix_dir, "report")
    target = out_file if out_file is not None else folder.report_file
    check_out(target)
    text = page(folder.path, collect(folder.path))
    try:
        write_text(target, text)
    except OSError as e:  # what os.access cannot foresee: a read-only file system, a full disk
        raise UserError(f"--out cannot be written: {e.strerror or e}", file=target) from None
    print(f"wrote {target} ({len(text.encode()) / 1024:.0f} KB)")
