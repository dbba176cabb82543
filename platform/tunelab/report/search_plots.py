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


def by_group(tables: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The searches of each method group together: its studies (tune.studies), in study order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for t in tables:
        out.setdefault(t["group"], []).append(t)
    return [sorted(ts, key=lambda t: t.get("study_index", 0)) for ts in out.values()]


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
    for lo, hi in (table.get("edge_zones") or {}).get(key, {}).values():
        # The edges of the range (the outer tenth; an int's or ordered choice's end value): a winner there says
        # the space may be too narrow (docs/tuning.md)
        if lo == hi:
            ax.axvline(lo, color="C1", alpha=0.5, linestyle=":")
        else:
            ax.axvspan(lo, hi, color="C1", alpha=0.12, label=None)


def _study(tables: list[dict[str, Any]], table: dict[str, Any]) -> str:
    return f"s{table.get('study_index', 0)}:" if len(tables) > 1 else ""


def _rungs(ax: Any, tables: list[dict[str, Any]]) -> None:
    """Values at the rungs: one colour per rung step; filled where the trial went on, hollow where it stopped."""
    steps = sorted({int(s) for table in tables for t in table["trials"] for s in t["intermediate"]})
    for j, step in enumerate(steps):
        labelled = False
        for table in tables:
            for t in table["trials"]:
                v = t["intermediate"].get(str(step), t["intermediate"].get(step))
                if v is None or math.isnan(v):
                    continue
                went_on = t["pruned_at"] != step and t["reached"] > step
                ax.plot([_x(table, t)], [v], marker="o", linestyle="none", color=f"C{j % 10}", markersize=6,
                        markerfacecolor=f"C{j % 10}" if went_on else "none",
                        label=None if labelled else f"step {step}")
                labelled = True
    ax.set_title(f"{tables[0]['intermediate']} at each rung (hollow: stopped)", fontsize=9)
    if steps:
        ax.legend(fontsize=7, loc="best")


def _ends(ax: Any, tables: list[dict[str, Any]]) -> None:
    """The objective of the trials that trained the full budget; each study's winner starred (red: at an edge of
    the space)."""
    n = 0
    for table in tables:
        done = [t for t in table["trials"] if t["state"] == "complete" and t["value"] is not None
                and not math.isnan(t["value"])]
        summary = table.get("summary") or {}
        winner, edge = summary.get("winner"), bool(summary.get("edges"))
        for t in done:
            star = t["number"] == winner
            ax.plot([_x(table, t)], [t["value"]], marker="*" if star else "D", markersize=12 if star else 6,
                    linestyle="none", color=("C3" if edge else "C2") if star else "C7")
            ax.annotate(f" {_study(tables, table)}t{t['number']}", (_x(table, t), t["value"]), fontsize=7)
        n += len(done)
    studies = f" in {len(tables)} studies" if len(tables) > 1 else ""
    ax.set_title(f"{tables[0]['metric']} at the full budget ({n} trial{'s' * (n != 1)}{studies}; star: chosen)",
                 fontsize=9)


def search_figure(tables: list[dict[str, Any]]) -> bytes | None:
    """One row per method group (its studies together): values at the rungs (left) and at the full budget
    (right), the edges of the searched range shaded."""
    if not tables:
        return None
    groups = by_group(tables)
    fig = Figure(figsize=(9, 2.8 * len(groups)))
    axes = fig.subplots(len(groups), 2, squeeze=False, sharex="row")
    for (left, right), group in zip(axes, groups):
        _rungs(left, group)
        _ends(right, group)
        for ax in (left, right):
            _axis(ax, group[0])
        left.set_ylabel(group[0]["group"], fontsize=9)
    fig.tight_layout()
    return _png(fig)


def profile_figure(profiles: list[dict[str, Any]], tau_max: float) -> bytes | None:
    """Each method's performance profile rho(tau) over the workloads, a step function from tau 1 to tau_max."""
    if not profiles:
        return None
    fig = Figure(figsize=(7, 3.6))
    ax = fig.subplots()
    for i, p in enumerate(profiles):
        finite = sorted(r for r in p["ratios"].values() if r is not None and r <= tau_max)
        n = len(p["ratios"]) or 1
        xs = [1.0, *finite, tau_max]
        ys = [sum(r <= x for r in finite) / n for x in xs]
        ax.step(xs, ys, where="post", color=f"C{i % 10}", label=f"{p['method']} ({p['score']:.2f})")
    ax.set_xlim(1.0, tau_max)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("tau: within this factor of the best method's score", fontsize=8)
    ax.set_ylabel("share of workloads", fontsize=8)
    n = max(len(p["ratios"]) for p in profiles)
    ax.set_title(f"performance profiles over {n} workload{'s' * (n != 1)} (legend: the area score)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return _png(fig)
