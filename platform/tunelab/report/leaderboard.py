"""report.leaderboard(runs/<matrix>/) -> leaderboard.md and .csv: one row per cell (its training joined with
the evaluation the matrix asks for)."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from rich.table import Table

from tunelab import folders
from tunelab.store import cell_dirs, read_json, read_status, write_text

TRAIN_COLUMNS = {  # summary.json key -> column header
    "final_loss": "train loss",
    "tokens_per_s": "tok/s",
    "peak_mem_mb": "peak MB",
    "train_seconds": "train s",
}


NOTE = ("Scores from eval/results.json of each cell; * marks a subset of the benchmark (see its limit and n "
        "there), `_smoke` a stand-in that is not the benchmark, `unavailable` a test set that could not be "
        "loaded. tok/s: non-padding tokens per second of training; peak MB: peak process RSS on CPU, CUDA max "
        "allocated on GPU (of the main process under multi-process layouts).")



def _entries(matrix_dir: Path) -> list[tuple[Path, dict]]:
    """(cell folder, {id, eval_id, slug, varying}) for each cell of the matrix as last run (cells.json); for a
    runs folder without one, every cell folder with its newest evaluation."""
    index = read_json(matrix_dir / "cells.json")
    if index is None:
        return [(d, {**(read_json(d / "cell.json") or {}), "eval_id": None}) for d in cell_dirs(matrix_dir)]
    return [(d, entry) for entry in index if (d := folders.find(matrix_dir, entry["id"])) is not None]


def _state(d: Path, eval_id: str | None) -> str:
    state = read_status(d).get("state", "?")
    if state == "done" and eval_id is not None and not folders.eval_done(d, eval_id):
        return "pending"  # trained, but not yet evaluated as the matrix now asks
    return state


def collect(matrix_dir: Path) -> list[dict]:
    rows = []
    for d, meta in _entries(matrix_dir):
        row = {"cell": meta.get("slug", d.name), "id": meta.get("id", ""), **meta.get("varying", {}),
               "status": _state(d, meta.get("eval_id"))}
        for name, res in (folders.results(d, meta.get("eval_id")).get("tasks") or {}).items():
            header = name if res.get("metric") in (None, "loss", name) else f"{name} {res['metric']}"
            # A test set that could not be had shows as such, never as a blank or a 0; smoke stand-ins
            # carry "_smoke" in their name, and subsets a "*" (see eval/<eval-id>/results.json).
            if res.get("status", "ok") != "ok":
                row[header] = "unavailable"
            else:
                row[header] = f"{fmt(res.get('value'))}*" if res.get("subset") else res.get("value")
        summary = read_json(d / "train" / "summary.json") or {}
        row.update({col: summary.get(key) for key, col in TRAIN_COLUMNS.items() if key in summary})
        rows.append(row)
    return rows


def columns(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(k for r in rows for k in r))


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def to_markdown(rows: list[dict], title: str) -> str:
    cols = columns(rows)
    lines = [f"# {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    lines += ["", NOTE]
    return "\n".join(lines) + "\n"


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns(rows), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def to_rich(rows: list[dict], title: str) -> Table:
    table = Table(title=title)
    # The terminal is narrow: the id and the varying config keys (dotted) stay in the files; the slug
    # already names each cell.
    cols = [c for c in columns(rows) if c != "id" and "." not in c]
    for c in cols:
        table.add_column(c, justify="right" if any(isinstance(r.get(c), (int, float)) for r in rows) else "left")
    for r in rows:
        table.add_row(*(fmt(r.get(c)) for c in cols))
    return table


def write(matrix_dir: Path) -> list[dict]:
    rows = collect(matrix_dir)
    write_text(matrix_dir / "leaderboard.md", to_markdown(rows, f"Leaderboard: {matrix_dir.name}"))
    write_text(matrix_dir / "leaderboard.csv", to_csv(rows))
    return rows
