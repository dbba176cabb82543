"""`exp tune status`: the searches of a matrix's run folder (tune/status.py gathers, this prints)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from tunelab.cli.common import INSPECT, Json, MatrixDir, app, out, print_json, print_wide
from tunelab.report.scores import fmt

tune_app = typer.Typer(no_args_is_help=True)
app.add_typer(tune_app, name="tune", help="Hyperparameter searches of a matrix's tune: section: their state "
              "(docs/tuning.md).", rich_help_panel=INSPECT)
COLORS = {"complete": "green", "pruned": "dim", "failed": "red", "running": "yellow", "stopped": "yellow",
          "waiting": "white"}


def _studies_table(title: str, rows: list[dict]) -> Table:
    table = Table(title=title, title_justify="left")
    counts = ("done", "pruned", "running", "stopped", "waiting", "failed")
    for col in ("group", *counts, "best so far", "steps", "study"):
        table.add_column(col, justify="right" if col in (*counts, "steps") else "left")
    for r in rows:
        best = r["best"]
        shown = f"{fmt(best['value'])} (trial {best['number']}: " + ", ".join(
            f"{k}={fmt(v)}" for k, v in best["params"].items()) + ")" if best else "-"
        study = f" (study {r['study_index'] + 1})" if r.get("studies", 1) > 1 else ""
        table.add_row(r["group"] + study, str(r["complete"]), str(r["pruned"]), str(r["running"]), str(r["stopped"]),
                      str(r["waiting"]), str(r["failed"]), shown, f"{r['steps']}/{r['planned_steps'] or '?'}",
                      r["study"])
    return table


def _trials_table(r: dict) -> Table:
    steps = sorted({s for t in r["trials"] for s in t["intermediate"]})
    table = Table(title=f"{r['group']}: trials ({r['schedule'] or ''})", title_justify="left")
    keys = list(dict.fromkeys(k for t in r["trials"] for k in t["params"]))
    for col in ("trial", *keys, "state", *(f"step {s}" for s in steps), r["metric"] or "value"):
        table.add_column(col, justify="left" if col == "state" else "right")
    for t in r["trials"]:
        table.add_row(str(t["number"]), *(fmt(t["params"].get(k)) for k in keys),
                      f"[{COLORS.get(t['state'], 'white')}]{t['state']}",
                      *(fmt(t["intermediate"].get(s)) for s in steps), fmt(t["value"]))
    return table


@tune_app.command("status")
def status_cmd(
    matrix_dir: MatrixDir,
    trials: Annotated[bool, typer.Option("--trials", help="also every trial: its point, state and rung values")
                      ] = False,
    as_json: Json = False,
) -> None:
    """Each search of a matrix: trials done, pruned, running and waiting, the best so far, steps spent of the
    schedule's plan (read from its Optuna study; `optuna-dashboard runs/<matrix>/tune/optuna.journal` shows it live)."""
    from tunelab.folders.matrix import open_matrix
    from tunelab.tune.edges import said
    from tunelab.tune.status import collect

    rows = collect(open_matrix(matrix_dir, "tune status").path)
    if as_json:
        return print_json(rows)
    print_wide(_studies_table(f"{matrix_dir.name}: searches", rows))
    for r in rows:  # a best value at an edge of its range: the space may be too narrow (docs/tuning.md)
        for e in r["edges"]:
            study = f" (study {r['study_index'] + 1} of {r['studies']})" if r["studies"] > 1 else ""
            best = "best" if r["waiting"] + r["running"] == 0 else "best so far"
            out.print(f"[yellow]{r['group']}{study}: {said(e, best)}", soft_wrap=True, highlight=False)
    for r in rows if trials else []:
        print_wide(_trials_table(r))
