"""`exp ls`, the --json outputs and `exp --help` grouped by what a user does, run as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import write


def exp(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "tunelab.cli", *map(str, args)], check=False, capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


def test_ls_lists_every_kind_with_a_line_each():
    from tunelab.core import registries

    p = exp("ls", "--json")
    assert p.returncode == 0, p.stderr
    kinds = json.loads(p.stdout)
    assert set(kinds) == {"models", "recipes", "suites", "tasks", "optimizers", "peft", "engines", "samplers",
                          "pruners", "intermediates", "experiments"}
    assert list(kinds["optimizers"]) == list(registries.OPTIMIZERS) and list(kinds["peft"]) == list(registries.PEFT)
    assert list(kinds["intermediates"]) == ["val_loss", "checkpoint"]
    assert {"arithmetic", "alpaca"} <= set(kinds["recipes"]) and {"quick", "paper"} <= set(kinds["suites"])
    assert "quickstart" in kinds["experiments"] and "(no description)" not in kinds["experiments"].values()
    assert all(isinstance(v, str) and v for k in kinds.values() for v in k.values())
    one = exp("ls", "suites")
    assert one.returncode == 0 and "quick" in one.stdout and "optimizers" not in one.stdout
    bad = exp("ls", "widgets")
    assert bad.returncode == 2 and "allowed are models" in bad.stderr and "Traceback" not in bad.stderr
    alias = exp("models", "--json")  # `exp models` is `exp ls models`, not a second listing
    assert alias.returncode == 0 and json.loads(alias.stdout) == {"models": kinds["models"]}


def test_help_groups_commands_by_what_a_user_does():
    p = exp("-h")
    assert p.returncode == 0
    panels = [line.strip("╭─ ").split(" ")[0] for line in p.stdout.splitlines() if line.startswith("╭─")]
    assert panels == ["Options", "Run", "Inspect", "Evaluate", "Export"]


def test_plan_status_and_leaderboard_speak_json(tmp_path):
    path = write(tmp_path / "m.yaml", "name: m\nbase:\n  model: {name: tiny-random-llama}\n"
                 "  data: {recipe: arithmetic, max_length: 64}\n  train: {steps: 1, batch_size: 2}\n"
                 "  eval: {tasks: [val_loss], val_batches: 1}\n  tracking: {wandb: false}\n"
                 "matrix:\n  optim.lr: [1.0e-3, 2.0e-3]\n")
    p = exp("plan", path, "--json")
    assert p.returncode == 0, p.stderr
    planned = json.loads(p.stdout)
    assert [c["varying"] for c in planned] == [{"optim.lr": 0.001}, {"optim.lr": 0.002}]
    assert all(len(c["id"]) == 10 and len(c["eval_id"]) == 10 for c in planned)
    assert planned[0]["eval_id"] == planned[1]["eval_id"] and planned[0]["id"] != planned[1]["id"]
    runs = tmp_path / "runs"
    assert exp("run", path, "--runs-dir", runs, "--only", "lr0.001").returncode == 0
    status = json.loads(exp("status", runs / "m", "--json").stdout)
    # lr0.002 is in the matrix but was never started: pending, with no folder
    assert [(s["cell"], s["state"], s["dir"] is None) for s in status] == [("lr0.001", "done", False),
                                                                           ("lr0.002", "pending", True)]
    assert status[0]["disk_bytes"] > 0 and status[0]["timings"]["train_s"] > 0
    board = json.loads(exp("leaderboard", runs / "m", "--json").stdout)["rows"]
    assert [(r["cell"], r["status"]) for r in board] == [("lr0.001", "done")]  # lr0.002 never ran
    assert board[0]["columns"]["val_loss"]["mean"] > 0
