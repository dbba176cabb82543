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
from tunelab.report import cost, plots, provenance, ranking, search_plots
from tunelab.report.leaderboard import FIGURES_NOTE, to_html
from tunelab.report.records import Record, left_out_notes
from tunelab.report.scores import fmt
from tunelab.report.table import Board, build, grouped

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
    many = any(t.get("studies", 1) > 1 for t in tables)
    return [{"group": t["group"], **({"study": t.get("study_index", 0) + 1} if many else {}),
             "bracket": d["bracket"] + 1, "rung step": d["step"],
             "trials (value)": ", ".join(f"t{n}: {fmt(v)}" for n, v in d["values"]),
             "went on": ", ".join(f"t{n}" for n in d["promoted"]), "ranked by": d["by"]}
            for t in tables for d in t.get("decisions", [])]


def _tuned_rows(records: list[Record]) -> list[tuple[str, list[Record]]]:
    return [(label, g) for label, g in grouped(records) if g[0].tune.get("role") == "tuned"]


def _costs(matrix_dir: Path, tuned: list[tuple[str, list[Record]]]) -> list[dict]:
    """Each tuned row's cost and, with several workloads, each method's in all (its rows on every workload)."""
    folders = cost.Folders(matrix_dir)
    rows = {label: cost.of_row([r.tune for r in g], [r.dir for r in g], folders) for label, g in tuned}
    methods: dict[str, list[Record]] = {}
    for _, g in tuned:
        if g[0].tune.get("workloads"):
            name = "-".join(str(v) for v in (g[0].tune.get("method") or {}).values())
            methods.setdefault(f"{name}-tuned, all workloads", []).extend(g)
    rows |= {label: cost.of_row([r.tune for r in g], [r.dir for r in g], folders) for label, g in methods.items()}
    return cost.by_group(rows)


def _rankings(tuned: list[tuple[str, list[Record]]]) -> list[dict]:
    """Every two tuned rows on the same workload: how often one ranks above the other on the search's objective
    when studies and seeds are drawn again (report/ranking.py; 10,000 draws, seed 0)."""
    rows = []
    for i, (la, ga) in enumerate(tuned):
        for lb, gb in tuned[i + 1:]:
            if ga[0].tune.get("workload") != gb[0].tune.get("workload"):
                continue
            found = ranking.of_rows(str(ga[0].tune.get("metric")), ga, gb)
            if found is not None:
                rows.append({"A": la, "B": lb, "task": found.task, "A value": fmt(found.a), "B value": fmt(found.b),
                             "A ranks above B": f"{found.above:.1%}", "studies": found.studies,
                             "seeds": found.seeds})
    return rows


def _searches(matrix_dir: Path, records: list[Record], board: Board) -> list[str]:
    """The searches of a matrix with a tune: section: values against the searched value (the edges of the space
    shaded), the rung decisions, what each method's search cost, how often one ranks above another, and the
    methods' profiles over the workloads."""
    tables = search_plots.searches(matrix_dir)
    if not tables:
        return []
    waiting = [f"{t['group']}: {t['blocked']}" for t in tables if t.get("blocked")]
    at_edge = [f"{t['group']}" + (f" (study {t.get('study_index', 0) + 1})" if t.get("studies", 1) > 1 else "")
               + f": best at the {e['side']} edge of {e['key']} ({fmt(e['value'])})"
               for t in tables for e in (t.get("summary") or {}).get("edges") or []]
    tuned = _tuned_rows(records)
    out = ["<h2>Searches</h2>",
           '<p class="note">Each method group searched with the same budget (docs/tuning.md). Left: every trial\'s '
           "intermediate value at each rung against the searched value (filled: it went on; hollow: pruned there); "
           "right: the objective of the trials that trained the full budget, each study's chosen one starred (red: "
           "at an edge of the space, shaded: the outer tenth of the range); its configuration is retrained with the "
           "matrix's seeds and scored in the leaderboard above.</p>",
           _img(search_plots.search_figure(tables), "objective against the searched value, per group",
                "no trial has reported yet"),
           *([f'<p class="note">Waiting: {_esc("; ".join(waiting))}</p>'] if waiting else []),
           *([f'<p class="note">At the edge of the space, widen it: {_esc("; ".join(at_edge))}</p>'] if at_edge
             else []),
           _table(_decisions(tables), "no rung decided yet (pruner none, or its first rung is not complete)")]
    if tuned:
        out += ["<h3>What each search cost</h3>",
                '<p class="note">Device-hours (CPU-hours on a CPU) of every run of the row\'s cells, measured by the '
                "cells (attempts.jsonl): its search (every trial of every study, by the rung step a run stopped at) "
                "and its retraining (each study's winner with the other seeds, and its evaluation on the suite). A "
                "run killed with its runner left no end and is not counted.</p>",
                _table(_costs(matrix_dir, tuned), "no run has ended yet"),
                "<h3>How often one method ranks above another</h3>",
                '<p class="note">On the search\'s objective, for two tuned rows on the same workload: the share of '
                "paired bootstrap draws of their studies and seeds (10,000, seed 0) in which A's median over studies "
                "is better than B's (ties count half). One study and one seed leave nothing to draw again.</p>",
                _table(_rankings(tuned), "no two tuned rows with scores yet")]
    if board.profiles:
        from tunelab.report.profiles import TAU_MAX

        out += ["<h3>Across workloads</h3>",
                _img(search_plots.profile_figure(board.profiles, TAU_MAX), "performance profiles over the workloads",
                     "no method has a score on every workload yet"),
                f'<p class="note">Each method\'s share of workloads on which its score is within a factor tau of the '
                f"best method's (Dolan & More 2002), from 1 to {TAU_MAX:g}; the legend gives the area under it over "
                f"{TAU_MAX - 1:g} (AlgoPerf's benchmark score). The table under the leaderboard lists the ratios.</p>"]
    return out


def page(matrix_dir: Path, records: list[Record], generated: float | None = None) -> str:
    generated = time.time() if generated is None else generated
    board = build(records, notes=left_out_notes(matrix_dir))
    body = [
        _header(matrix_dir, records, generated),
        f'<div class="scroll">{to_html(board, "Leaderboard")}</div>' if board.rows
        else '<h2>Leaderboard</h2>\n<p class="note">no cell has started yet</p>',
        *_searches(matrix_dir, records, board),
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
