"""`exp compare A B`: print (or --json) what report/compare.py finds."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from tunelab.report.compare import Comparison, compare_cells, pairs
from tunelab.report.scores import fmt

out = Console()


def _pct(p: float | None) -> str:
    return "-" if p is None else (f"{p:.3g}" if p >= 1e-4 else "<1e-4")


def _show(c: Comparison) -> None:
    out.print(f"[bold]A[/] {c.a.dir}\n[bold]B[/] {c.b.dir}")
    table = Table(title="config: what differs", title_justify="left")
    for col in ("key", "A", "B"):
        table.add_column(col)
    for k, (va, vb) in c.config_diff.items():
        table.add_row(k, fmt(va), fmt(vb))
    out.print(table if c.config_diff else "config: identical")
    table = Table(title="scores: B - A, paired over the same items", title_justify="left")
    for col in ("task", "A", "B", "B - A", "95% CI", "p", "test", "items"):
        table.add_column(col, justify="left" if col in ("task", "test") else "right")
    for t in c.tasks:
        r = t.result
        if r is None:
            va, vb = t.values
            both = isinstance(va, (int, float)) and isinstance(vb, (int, float))
            table.add_row(t.task, fmt(va), fmt(vb), f"{vb - va:+.4g}" if both else "", "", "",
                          f"no test: {t.refused}", "")
        else:
            table.add_row(t.task, fmt(r.a), fmt(r.b), f"{r.diff:+.4g}", f"[{r.ci[0]:+.3g}, {r.ci[1]:+.3g}]",
                          _pct(r.p), r.test, str(r.n))
    out.print(table)
    table = Table(title="training", title_justify="left")
    for col in ("figure", "A", "B", "B - A", "B / A"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for name, (va, vb) in c.figures.items():
        both = isinstance(va, (int, float)) and isinstance(vb, (int, float))
        table.add_row(name, fmt(va), fmt(vb), f"{vb - va:+.4g}" if both else "-",
                      f"{vb / va:.3g}x" if both and va else "-")
    out.print(table)


def _as_json(c: Comparison) -> dict:
    return {"a": str(c.a.dir), "b": str(c.b.dir), "config_diff": c.config_diff, "figures": c.figures,
            "tasks": [{"task": t.task, "refused": t.refused or None, "values": t.values,
                       **({**asdict(t.result), "p": t.result.p, "test": t.result.test} if t.result else {})}
                      for t in c.tasks]}


def compare_cmd(
    a: Annotated[Path, typer.Argument(help="a cell folder runs/<matrix>/<cell>/, or a matrix's run folder")],
    b: Annotated[Path, typer.Argument(help="the other cell (or matrix) folder")],
    resamples: Annotated[int, typer.Option(help="paired bootstrap resamples")] = 10_000,
    seed: Annotated[int, typer.Option(help="seed of the bootstrap")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON for programs")] = False,
) -> None:
    """Compare two cells (or two matrices, cell by cell): config, scores with paired significance tests
    (McNemar, paired bootstrap), training loss, memory and speed."""
    from tunelab.errors import UserError

    if resamples < 100:
        raise UserError(f"--resamples {resamples}: use at least 100 (the p-values are counts over resamples)")
    results = [compare_cells(x, y, resamples, seed) for x, y in pairs(a, b)]
    if as_json:
        print(json.dumps([_as_json(c) for c in results], indent=2, default=str))
        return
    for c in results:
        _show(c)
