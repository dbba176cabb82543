"""Train once, evaluate many: a new eval task on a finished matrix evaluates the saved final/ weights and
trains nothing; folders of the first layout (one id over everything, eval/results.json) keep working."""

from __future__ import annotations

import json
import os
import shutil

from conftest import write

from tunelab.core.files import read_json

MATRIX = """name: again
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 64}
  optim: {lr: 1.0e-3}
  train: {steps: 2, batch_size: 2}
  eval: {tasks: TASKS, val_batches: 2, limit: 1, max_new_tokens: 4}
  tracking: {wandb: false}
matrix:
  peft.method: [none, lora]
"""


def matrix(tmp_path, tasks: str):
    return write(tmp_path / "again.yaml", MATRIX.replace("TASKS", tasks))


def trained_files(mdir):
    return {p: p.stat().st_mtime_ns for p in mdir.glob("*/train/metrics.jsonl")} | \
        {p: p.stat().st_mtime_ns for p in mdir.glob("*/final/*")}


def test_a_new_task_evaluates_the_saved_model_and_trains_nothing(cli, tmp_path):
    runs = tmp_path / "runs"
    code, _, err = cli("run", matrix(tmp_path, "[val_loss]"), "--runs-dir", runs)
    assert code == 0, err
    mdir = runs / "again"
    before = trained_files(mdir)
    assert len(before) > 2

    code, out, err = cli("run", matrix(tmp_path, "[val_loss, humaneval]"), "--runs-dir", runs)
    assert code == 0, err
    assert trained_files(mdir) == before  # nothing trained, no weights rewritten
    for cell in sorted(p for p in mdir.iterdir() if p.is_dir()):
        status = read_json(cell / "status.json")
        assert status["state"] == "done" and status["evaluating_only"] is True and status["trained"] is True
        assert "train_s" in status["timings"] and "eval_s" in status["timings"]
        evals = {p.name: read_json(p / "results.json") for p in (cell / "eval").iterdir()}
        assert len(evals) == 2 and all(r["complete"] for r in evals.values())
        assert sorted(len(r["tasks"]) for r in evals.values()) == [1, 2]
        # the training's final validation loss is reused: it was measured as this evaluation asks
        again = next(r for r in evals.values() if "humaneval" in r["tasks"])
        assert again["tasks"]["val_loss"]["value"] == read_json(cell / "train" / "summary.json")["val_loss"]
    board = (mdir / "leaderboard.csv").read_text()
    assert "humaneval pass@1" in board.splitlines()[0]

    code, _, err = cli("run", matrix(tmp_path, "[val_loss, humaneval]"), "--runs-dir", runs)
    assert code == 0 and err.count("done, skipped") == 2


def test_a_first_layout_folder_is_adopted_without_retraining(cli, tmp_path):
    runs = tmp_path / "runs"
    path = matrix(tmp_path, "[val_loss]")
    code, _, err = cli("run", path, "--runs-dir", runs)
    assert code == 0, err
    mdir = runs / "again"
    for cell in (p for p in mdir.iterdir() if p.is_dir()):  # rewrite it as the first layout left it
        (evaluation,) = (cell / "eval").iterdir()
        for f in evaluation.iterdir():
            shutil.move(f, cell / "eval" / f.name)
        evaluation.rmdir()
        meta = read_json(cell / "cell.json")
        (cell / "cell.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "layout"} | {"id": "0" * 10}))
        status = read_json(cell / "status.json")
        status.pop("trained")
        (cell / "status.json").write_text(json.dumps(status))
    os.remove(mdir / "cells.json")
    before = trained_files(mdir)

    code, _, err = cli("run", path, "--runs-dir", runs)
    assert code == 0, err
    assert err.count("done, skipped") == 2 and trained_files(mdir) == before
    for cell in (p for p in mdir.iterdir() if p.is_dir()):
        meta = read_json(cell / "cell.json")
        assert meta["layout"] == 2 and meta["old_id"] == "0" * 10 and meta["id"] in cell.name
        assert [p.name for p in (cell / "eval").iterdir()] != ["results.json"]
        assert read_json(next((cell / "eval").glob("*/results.json")))["complete"]
