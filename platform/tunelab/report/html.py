"""The report of a matrix's run folder as one self-contained HTML page.

Everything is inside the file: the figures are base64 PNG data URIs, the style sheet is inline, there is no
script and no font, stylesheet or icon from elsewhere, so the page opens the same from a laptop, an e-mail or
a CI artifact, offline. Sections: header (matrix, when, tunelab version, cell counts), the leaderboard
(report/leaderboard.py's HTML of the default board, with its note on the marks), loss curves, scores along
training (eval.checkpoints), memory and speed bars, and the provenance of every score and cell.
"""

from __future__ import annotations

import base64
import html
import time
from collections import Counter
from pathlib import Path

import pandas as pd

from tunelab import __version__
from tunelab.folders.matrix import MatrixFolder
from tunelab.report import plots, provenance, search_plots
from tunelab.report.leaderboard import FIGURES_NOTE, to_html
from tunelab.report.records import Record, left_out_notes
from tunelab.report.scores import fmt
from tunelab.report.table import build

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; padding: 0 1em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
.meta { color: #555; margin: 0.2em 0; } .counts span { margin-right: 1em; }
.failed { color: #b00; } .done { color: #070; } .pending, .running { color: #a60; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; font-size: 13px; margin: 0.5em 0; }
th, td { padding: 3px 8px; border-bottom: 1px solid #e4e4e4; text-align: left; white-space: nowrap; }
th { background: #f4f4f4; } .long { white-space: normal; min-width: 16em; max-width: 26em; }
.note { color: #555; font-size: 13px; max-width: 1000px; }
img { max-width: 100%; height: auto; display: block; margin: 0.5em 0; }
"""


def _esc(text) -> str:
    return html.escape(str(text))


def _img(png: bytes | None, alt: str, missing: str) -> str:
    if png is None:
        return f'<p class="note">{_esc(missing)}</p>'
    return f'<img alt="{_esc(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _table(rows: list[dict], empty: str) -> str:
    if not rows:
        return f'<p class="note">{_esc(empty)}</p>'
    def cell(v) -> str:  # long text (marks, data source, an error) wraps; the rest stays on one line
        text = _esc(v)
        return f'<div class="long">{text}</div>' if len(text) > 40 else text

    table = pd.DataFrame(rows).fillna("-").map(cell).to_html(index=False, border=0, escape=False)
    return f'<div class="scroll">{table}</div>'


def counts(matrix_dir: Path, records: list[Record]) -> Counter:
    """Cells by state; a cell of cells.json that has no folder yet (not started) counts as pending."""
    states = Counter(r.state for r in records)
    index = MatrixFolder(matrix_dir).index() or []
    started = {r.id for r in records}
    not_started = sum(1 for e in index if isinstance(e, dict) and e.get("id") not in started)
    if not_started:
        states["pending"] += not_started
    return states


def _header(matrix_dir: Path, records: list[Record], generated: float) -> str:
    spec = MatrixFolder(matrix_dir).index()
    desc = MatrixFolder(matrix_dir).description()
    states = counts(matrix_dir, records)
    total = sum(states.values())
    shown = ["done", "failed", "pending", *sorted(s for s in states if s not in ("done", "failed", "pending"))]
    parts = " ".join(f'<span class="{_esc(s)}">{states.get(s, 0)} {_esc(s)}</span>' for s in shown)
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(generated))
    return (f"<h1>{_esc(matrix_dir.name)}</h1>\n"
            + (f'<p class="meta">{_esc(desc)}</p>\n' if desc else "")
            + f'<p class="meta">generated {_esc(when)} by tunelab {_esc(__version__)} from '
              f"<code>{_esc(matrix_dir.resolve())}</code></p>\n"
            + f'<p class="meta counts"><b>{total} cells</b>{": " if total else ""}{parts}'
            + ("" if spec is not None else " (no cells.json: every cell folder, its newest evaluation)")
            + "</p>\n")


def _decisions(tables: list[dict]) -> list[dict]:
    return [{"group": t["group"], "bracket": d["bracket"] + 1, "rung step": d["step"],
             "trials (value)": ", ".join(f"t{n}: {fmt(v)}" for n, v in d["values"]),
             "went on": ", ".join(f"t{n}" for n in d["promoted"]), "ranked by": d["by"]}
            for t in tables for d in t.get("decisions", [])]


def _searches(matrix_dir: Path) -> list[str]:
    """The searches of a matrix with a tune: section: values against the searched value, the rung decisions."""
    tables = search_plots.searches(matrix_dir)
    if not tables:
        return []
    waiting = [f"{t['group']}: {t['blocked']}" for t in tables if t.get("blocked")]
    return ["<h2>Searches</h2>",
            '<p class="note">Each method group searched with the same budget (docs/tuning.md). Left: every trial\'s '
            "intermediate value at each rung against the searched value (filled: it went on; hollow: pruned there); "
            "right: the objective of the trials that trained the full budget, the chosen one starred; its "
            "configuration is retrained with the matrix's seeds and scored in the leaderboard above.</p>",
            _img(search_plots.search_figure(tables), "objective against the searched value, per group",
                 "no trial has reported yet"),
            *([f'<p class="note">Waiting: {_esc("; ".join(waiting))}</p>'] if waiting else []),
            _table(_decisions(tables), "no rung decided yet (pruner none, or its first rung is not complete)")]


def page(matrix_dir: Path, records: list[Record], generated: float | None = None) -> str:
    generated = time.time() if generated is None else generated
    board = build(records, notes=left_out_notes(matrix_dir))
    body = [
        _header(matrix_dir, records, generated),
        f'<div class="scroll">{to_html(board, "Leaderboard")}</div>' if board.rows
        else '<h2>Leaderboard</h2>\n<p class="note">no cell has started yet</p>',
        *_searches(matrix_dir),
        "<h2>Loss curves</h2>",
        _img(plots.loss_curves(records), "loss curves of every cell", "no cell has logged a training step yet"),
        "<h2>Scores along training</h2>",
        _img(plots.score_curves(records), "checkpoint scores against step",
             "no checkpoint has been scored (eval.checkpoints: {every: N} scores them along training)"),
        '<p class="note">Each checkpoint\'s scores (eval.checkpoints) against its step, one line per configuration: '
        "seeds folded into their mean, the band ± one standard deviation over them; a star marks the checkpoint "
        "train.select made final/. <code>*</code>: a subset of the benchmark.</p>",
        "<h2>Memory and speed</h2>",
        _img(plots.throughput_bars(records), "peak memory and tokens/s per configuration",
             "no cell has finished training yet"),
        '<p class="note">One bar per configuration, coloured by optimizer x PEFT method; a configuration run with '
        "several seeds shows their mean and the standard deviation over runs as the error bar. "
        f"{_esc(FIGURES_NOTE)}</p>",
        "<h2>Provenance of every score</h2>",
        '<p class="note">Per cell and task, as its results.json says: task version and prompt hash (lm-eval tasks), '
        "shots, data source, harness, n and the marks (<code>*</code> subset, stand-in, unavailable).</p>",
        _table(provenance.score_rows(records), "no cells"),
        "<h2>Cells</h2>",
        '<p class="note">Each cell\'s state and what it ran with (env.json).</p>',
        _table(provenance.cell_rows(records), "no cells"),
        "<h2>Versions</h2>",
        '<p class="note">The <code>versions</code> block of each cell\'s results.json.</p>',
        _table(provenance.version_rows(records), "no evaluation has written results.json yet"),
    ]
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{_esc(matrix_dir.name)}: tunelab report</title>\n"
            '<link rel="icon" href="data:,">\n'  # no favicon request: the page asks nothing of anyone
            f"<style>{STYLE}</style>\n</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n")
