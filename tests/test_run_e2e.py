"""`exp run` end to end on a tiny random model: cells, run store, skip, failures, leaderboard."""

from __future__ import annotations

import csv
import json
import re

import pytest
from conftest import write

from tunelab.core.files import read_jsonl

TINY = """name: tiny
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 128}
  optim: {lr: 1.0e-3}
  train: {steps: 3, batch_size: 2, warmup_steps: 1}
  eval: {limit: 2, max_new_tokens: 8, val_batches: 2}
  tracking: {wandb: WANDB}
matrix:
  peft.method: [none, lora]
"""


@pytest.fixture(scope="module")
def done_run(tmp_path_factory):
    """One real `exp run` shared by the tests below (each cell is a real subprocess)."""
    import os
    import subprocess
    import sys

    tmp = tmp_path_factory.mktemp("e2e")
    path = write(tmp / "tiny.yaml", TINY.replace("WANDB", "true"))
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, "-m", "tunelab.cli", "run", str(path), "--runs-dir", str(tmp / "runs")],
                          check=False,
                          capture_output=True, text=True, env=env, timeout=600)
    return tmp, path, proc


def test_run_writes_the_store_and_leaderboard(done_run):
    tmp, _, proc = done_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    mdir = tmp / "runs" / "tiny"
    cells = sorted(p for p in mdir.iterdir() if p.is_dir())
    assert [c.name.split("-")[0] for c in cells] == ["lora", "none"]
    for cell in cells:
        (evaluation,) = (cell / "eval").iterdir()  # eval/<eval-id>/: this evaluation's results
        for f in ("config.yaml", "status.json", "env.json", "cell.json", "train/metrics.jsonl", "train/summary.json",
                  f"eval/{evaluation.name}/results.json", f"eval/{evaluation.name}/samples.jsonl"):
            assert (cell / f).is_file(), f"{cell.name}/{f}"
        assert json.loads((cell / "status.json").read_text())["state"] == "done"
        steps = read_jsonl(cell / "train" / "metrics.jsonl")
        assert [s["step"] for s in steps] == [1, 2, 3]
        assert all(s["loss"] > 0 and s["tokens_per_s"] > 0 and s["peak_mem_mb"] > 0 for s in steps)
        tasks = json.loads((evaluation / "results.json").read_text())["tasks"]
        assert tasks["humaneval"]["n"] == 2 and 0 <= tasks["humaneval"]["value"] <= 1
        assert tasks["val_loss"]["value"] > 0
        assert list((cell / "wandb").glob("offline-run-*")), "W&B offline run missing"
    lora = next(c for c in cells if c.name.startswith("lora"))
    assert (lora / "final" / "adapter_config.json").is_file()  # PEFT saves the adapter only
    none = next(c for c in cells if c.name.startswith("none"))
    assert (none / "final" / "model.safetensors").is_file()
    rows = list(csv.DictReader((mdir / "leaderboard.csv").open()))
    assert {r["cell"] for r in rows} == {"none", "lora"}
    # 2 of HumanEval's 164 problems: a subset, which the CSV marks in its own column (its number stays a number).
    assert all(r["status"] == "done" and "subset" in r["humaneval pass@1 marks"] for r in rows)
    assert all(float(r["humaneval pass@1"]) in (0.0, 0.5, 1.0) for r in rows)  # a pass rate over 2 problems
    assert re.search(r"^\| cell +\|", (mdir / "leaderboard.md").read_text(), re.M)
    assert "leaderboard" in proc.stdout


def test_second_run_skips_done_cells(done_run, cli):
    tmp, path, _ = done_run
    before = {p: p.stat().st_mtime_ns for p in (tmp / "runs" / "tiny").glob("*/train/metrics.jsonl")}
    code, out, err = cli("run", path, "--runs-dir", tmp / "runs")
    assert code == 0, err
    assert err.count("done, skipped") == 2
    assert before == {p: p.stat().st_mtime_ns for p in before}


def test_failed_cell_is_recorded_and_rerun_on_request(cli, tmp_path, monkeypatch):
    # A hub id that cannot be had: with HF_HUB_OFFLINE set, `exp run` would refuse it before running (exp plan's
    # machine check); here the hub is only unreachable (a closed local port), which the cell finds out itself.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    text = TINY.replace("WANDB", "false").replace(
        "  peft.method: [none, lora]", "  model.name: [tiny-random-llama, no-such-org/no-such-model]")
    path = write(tmp_path / "tiny.yaml", text)
    runs = tmp_path / "runs"
    code, out, err = cli("run", path, "--runs-dir", runs)
    assert code == 1
    states = {p.parent.name.split("-")[0]: json.loads(p.read_text()) for p in (runs / "tiny").glob("*/status.json")}
    assert states["tiny"]["state"] == "done"  # the matrix went on past the failure
    bad = states["no"]
    assert bad["state"] == "failed" and "no-such-org/no-such-model" in bad["error"]

    code, _, err = cli("run", path, "--runs-dir", runs)
    assert code == 1 and "failed, skipped" in err and "--rerun-failed" in err

    code, _, err = cli("run", path, "--runs-dir", runs, "--rerun-failed", "--only", "no-such*")
    assert code == 1
    again = json.loads(next((runs / "tiny").glob("no-*/status.json")).read_text())
    assert again["state"] == "failed" and again["started_at"] > bad["started_at"]

    code, out, _ = cli("status", runs / "tiny")
    assert code == 0 and "failed" in out and "done" in out
