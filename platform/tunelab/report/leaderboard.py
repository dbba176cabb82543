"""The leaderboard of runs/<matrix>/ in every format a paper or a program wants: md, csv, latex, html, json.

Each score column comes with its spread (`±`: the standard error of a single run, from results.json, or the
standard deviation over folded seeds), `runs` says how many finished runs stand behind a row, the best value
of each column is marked (bold; `best` in json), and the marks of report/scores.py (`*` subset, `_smoke`
stand-in, `unavailable`, `failed`) read the same in every format.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pandas as pd
from rich.table import Table

from tunelab.core.files import write_text
from tunelab.folders.matrix import MatrixFolder
from tunelab.report.records import collect, left_out_notes
from tunelab.report.scores import MARKS, TEST_SELECTED, fmt, marked
from tunelab.report.table import Board, Stat, build

FORMATS = ("md", "csv", "latex", "html", "json")
PROFILE_TITLE = ("Across workloads: each method's performance profile rho(tau) (the share of workloads within a "
                 "factor tau of the best), its score and its ratio r on each workload")
FIGURES_NOTE = ("tok/s: non-padding tokens per second of training; peak MB: measured, the peak resident memory of the "
                "process on CPU (interpreter, libraries and freed memory the allocator keeps included) or CUDA's max "
                "allocated on GPU (tensors), of the main process under multi-process layouts; predicted MB: `exp "
                "memory`'s model of the tensors alone (weights, gradients, optimizer state, activations, engine "
                "buffers) for rows as long as the cell's longest training row, so on CPU it leaves out the "
                "process's baseline (train/memory.json: rss_before_load_mb).")


def note(board: Board) -> str:
    spread = ("±: the standard deviation over the runs of a row (runs = how many finished; a value of one run has "
              "none)"
              if board.spread_kind == "std" else "±: the standard error of the score (results.json)")
    return " ".join([MARKS, f"{spread}.", FIGURES_NOTE, *board.notes])


def frame(board: Board, bold=lambda text: text, spread: bool = True, joined: bool = False) -> pd.DataFrame:
    """The table as display strings; `bold` wraps the best value of each column (per format). The spread is a
    column of its own ("X ±", left out where no row has one) or, `joined`, part of the value's cell
    ("0.25 ± 0.16", as a paper prints it)."""
    many = any(r["runs"] > 1 for r in board.rows)
    out = []
    for r in board.rows:
        row = {"cell": r["cell"], **{k: "" if r[k] is None else fmt(r[k]) for k in board.keys}, "status": r["status"]}
        if many:
            row["runs"] = r["runs"]
        for col in board.columns:
            st: Stat = r[col.name]
            text = marked(st.mean, st.subset, st.unavailable, st.test_selected) + _range(st)
            with_spread = spread and (col.kind == "score" or many) and st.spread is not None
            if joined and with_spread:
                text = f"{text} ± {fmt(st.spread)}"
            row[col.name] = bold(text) if st.best else text
            if spread and not joined and (col.kind == "score" or many):
                row[f"{col.name} ±"] = fmt(st.spread) if with_spread else ""
        out.append(row)
    df = pd.DataFrame(out)
    empty = [c for c in df.columns if c.endswith(" ±") and (df[c] == "").all()]
    return df.drop(columns=empty)


def _range(st: Stat) -> str:
    """A tuned row of several studies: its value is their median, shown with [min, max] over them."""
    return f" [{fmt(st.low)}, {fmt(st.high)}]" if st.studies > 1 else ""


def to_csv(board: Board) -> str:
    """Numbers stay numbers (a program reads them as written): each score or figure is its value, its spread
    and its marks (subset, stand-in, unavailable, best, the median of N studies), each in a column of its own; a
    board with studies adds each value's min and max over them."""
    studied = any(r[c.name].studies > 1 for r in board.rows for c in board.columns)
    out = []
    for r in board.rows:
        row = {"cell": r["cell"], **{k: r[k] for k in board.keys}, "status": r["status"], "runs": r["runs"]}
        for col in board.columns:
            st: Stat = r[col.name]
            marks = [m for m, on in (("subset", st.subset), ("stand-in", st.stand_in),
                                      ("unavailable", st.unavailable), ("best", st.best),
                                      ("test-selected", st.test_selected),
                                      (f"median-of-{st.studies}-studies", st.studies > 1)) if on]
            row |= {col.name: st.mean, f"{col.name} ±": st.spread, f"{col.name} marks": " ".join(marks),
                    **({f"{col.name} n": st.items} if col.kind == "score" else {})}
            if studied:
                row |= {f"{col.name} min": st.low, f"{col.name} max": st.high}
        out.append({**row, "notes": " ".join(r.get("tags", []))})  # the board's notes that concern this row
    return pd.DataFrame(out).to_csv(index=False)


def profile_frame(board: Board) -> pd.DataFrame:
    """Each method's profile over the workloads as display strings (empty without tune.workloads)."""
    rows = [{"method": p["method"], "workloads": p["workloads"], "score": f"{p['score']:.3f}",
             **{k: f"{v:.2f}" for k, v in p.items() if k.startswith("rho(")},
             **{f"r {w}": "inf" if r is None else f"{r:.3g}" for w, r in p["ratios"].items()}} for p in board.profiles]
    return pd.DataFrame(rows)


def _latex_escape(text: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("$", r"\$"), ("#", r"\#"),
                 ("_", r"\_"), ("{", r"\{"), ("}", r"\}"), ("~", r"\textasciitilde{}"), ("^", r"\^{}")):
        text = text.replace(a, b)
    return text


def to_latex(board: Board, title: str) -> str:
    """booktabs, ready to paste (needs \\usepackage{booktabs}); each score's spread in its cell."""
    df = frame(board, bold=lambda t: f"\\textbf{{{_latex_escape(t)}}}", joined=True)
    df = df.map(lambda v: (v if str(v).startswith("\\textbf") else _latex_escape(str(v))).replace("±", r"$\pm$"))
    df.columns = [_latex_escape(c) for c in df.columns]
    numeric = {_latex_escape(c.name) for c in board.columns} | {"runs"}
    body = df.to_latex(index=False, escape=False,  # numbers right-aligned, so their digits line up
                       column_format="".join("r" if c in numeric else "l" for c in df.columns))
    if board.profiles:
        prof = profile_frame(board).map(lambda v: _latex_escape(str(v)))
        prof.columns = [_latex_escape(c) for c in prof.columns]
        body += f"% {PROFILE_TITLE}\n" + prof.to_latex(index=False, escape=False,
                                                         column_format="l" + "r" * (len(prof.columns) - 1))
    return f"% {title}: {note(board)}\n{body}"


def to_html(board: Board, title: str) -> str:
    df = frame(board, bold=lambda t: f"<b>{html.escape(t)}</b>", joined=True)  # a page to read: spreads in cells
    df = df.map(lambda v: v if str(v).startswith("<b>") else html.escape(str(v)))
    table = df.to_html(index=False, escape=False, classes="leaderboard", border=0)
    if board.profiles:
        table += (f"\n<h3>{html.escape(PROFILE_TITLE)}</h3>\n"
                  + profile_frame(board).to_html(index=False, classes="leaderboard", border=0))
    text = re.sub(r"`([^`]*)`", r"<code>\1</code>", html.escape(note(board)))  # the marks note is markdown
    return f"<h2>{html.escape(title)}</h2>\n{table}\n<p class=\"note\">{text}</p>\n"


def to_json(board: Board) -> str:
    rows = []
    for r in board.rows:
        rows.append({"cell": r["cell"], "status": r["status"], "runs": r["runs"], **{k: r[k] for k in board.keys},
                     "notes": r.get("tags", []),
                     "columns": {c.name: {**r[c.name].__dict__, "kind": c.kind, "higher_is_better": c.higher_is_better}
                                 for c in board.columns}})
    return json.dumps({"rows": rows, "spread": board.spread_kind, "note": note(board),
                       **({"profiles": board.profiles} if board.profiles else {})}, indent=2, default=str)


def _md_bold(text: str) -> str:
    value = text.rstrip("*" + TEST_SELECTED)
    return f"**{value}**" + text[len(value):].replace("*", "\\*")


def render(board: Board, fmt_name: str, title: str) -> str:
    if fmt_name == "md":  # the marks stay outside the bold markers, the subset's escaped
        table = frame(board, bold=_md_bold).to_markdown(index=False, tablefmt="pipe")
        if board.profiles:
            table += f"\n\n## {PROFILE_TITLE}\n\n" + profile_frame(board).to_markdown(index=False, tablefmt="pipe")
        return f"# {title}\n\n{table}\n\n{note(board)}\n"
    if fmt_name == "csv":
        return to_csv(board)
    if fmt_name == "latex":
        return to_latex(board, title)
    if fmt_name == "html":
        return to_html(board, title)
    if fmt_name == "json":
        return to_json(board) + "\n"
    raise ValueError(f"unknown format {fmt_name!r}; formats: {', '.join(FORMATS)}")


def to_rich(board: Board, title: str) -> Table:
    """The terminal's table: the .md file's columns (config keys, each score's ±), every value in full; a board
    with no row says why (cli.common.print_wide fits it to the terminal)."""
    from rich.markup import escape

    df = frame(board, bold=lambda t: f"[bold]{escape(t)}[/]")
    table = Table(title=title)
    columns = list(df.columns) or ["cell", "status"]
    numeric = {c.name for c in board.columns} | {f"{c.name} ±" for c in board.columns} | {"runs"}
    for c in columns:
        table.add_column(str(c), justify="right" if c in numeric else "left")
    for row in df.itertuples(index=False):
        table.add_row(*(v if str(v).startswith("[bold]") else escape(str(v)) for v in row))
    if not board.rows:
        table.caption = "no results yet"
    elif board.notes:  # what this board says of itself (cells left out, weights that are stand-ins): not the legend
        table.caption, table.caption_justify = escape(" ".join(board.notes)), "left"
    return table


def write(matrix_dir: Path, **options) -> Board:
    """leaderboard.md, .csv, .tex and .json of a matrix's run folder (seeds folded unless aggregate=False)."""
    board = build(collect(matrix_dir), notes=left_out_notes(matrix_dir), **options)
    title = f"Leaderboard: {matrix_dir.name}"
    for ext, name in (("md", "md"), ("csv", "csv"), ("tex", "latex"), ("json", "json")):
        write_text(MatrixFolder(matrix_dir).leaderboard_file(ext), render(board, name, title))
    return board
