"""The report's figures of a matrix's searches (tunelab.tune): per method group, each trial's value against the
searched value, at every rung (which trials went on, which were pruned there) and at the full budget.

They are drawn from the files a search writes, runs/<matrix>/tune/studies.json and each study's trials.json,
so the report needs nothing but the run folder.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from tunelab.core.files import read_json
from tunelab.folders.matrix import REWRITE, MatrixFolder
from tunelab.report.plots import _png


def searches(matrix_dir: Path) -> list[dict[str, Any]]:
    """Every search's trials.json (written after each rung), in the order of tune/studies.json."""
    index = read_json(MatrixFolder(matrix_dir).studies_file, list, REWRITE) or []
    return [t for entry in index if (t := read_json(matrix_dir / entry["trials_file"], dict, REWRITE))]


def _x(table: dict[str, Any], trial: dict[str, Any]) -> Any:
    return trial["params"].get(next(iter(table["space"])))


def _axis(ax: Any, table: dict[str, Any]) -> None:
    key = next(iter(table["space"]))
    kind = next(iter(table["space"][key]))
    if kind == "log_uniform":
        ax.set_xscale("log")
    ax.set_xlabel(key + (f" (also searched: {', '.join(list(table['space'])[1:])})" if len(table["space"]) > 1
                         else ""), fontsize=8)
    ax.grid(alpha=0.3)


def _rungs(ax: Any, table: dict[str, Any]) -> None:
    """Values at the rungs: one colour per rung step; filled where the trial went on, hollow where it stopped."""
    steps = sorted({int(s) for t in table["trials"] for s in t["intermediate"]})
    for j, step in enumerate(steps):
        labelled = False
        for t in table["trials"]:
            v = t["intermediate"].get(str(step), t["intermediate"].get(step))
            if v is None or math.isnan(v):
                continue
            went_on = t["pruned_at"] != step and t["reached"] > step
            ax.plot([_x(table, t)], [v], marker="o", linestyle="none", color=f"C{j % 10}", markersize=6,
                    markerfacecolor=f"C{j % 10}" if went_on else "none",
                    label=None if labelled else f"step {step}")
            labelled = True
    ax.set_title(f"{table['intermediate']} at each rung (filled: went on; hollow: stopped)", fontsize=9)
    if steps:
        ax.legend(fontsize=7, loc="best")


def _ends(ax: Any, table: dict[str, Any]) -> None:
    """The objective of the trials that trained the full budget; the winner starred."""
    done = [t for t in table["trials"] if t["state"] == "complete" and t["value"] is not None
            and not math.isnan(t["value"])]
    winner = (table.get("summary") or {}).get("winner")
    for t in done:
        star = t["number"] == winner
        ax.plot([_x(table, t)], [t["value"]], marker="*" if star else "D", markersize=12 if star else 6,
                linestyle="none", color="C3" if star else "C7")
        ax.annotate(f" t{t['number']}", (_x(table, t), t["value"]), fontsize=7)
    ax.set_title(f"{table['metric']} at the full budget ({len(done)} trial{'s' * (len(done) != 1)}; star: chosen)",
                 fontsize=9)


def search_figure(tables: list[dict[str, Any]]) -> bytes | None:
    """One row per method group: values at the rungs (left) and at the full budget (right)."""
    if not tables:
        return None
    fig = Figure(figsize=(9, 2.8 * len(tables)))
    axes = fig.subplots(len(tables), 2, squeeze=False, sharex="row")
    for (left, right), table in zip(axes, tables):
        _rungs(left, table)
        _ends(right, table)
        for ax in (left, right):
            _axis(ax, table)
        left.set_ylabel(table["group"], fontsize=9)
    fig.tight_layout()
    return _png(fig)
