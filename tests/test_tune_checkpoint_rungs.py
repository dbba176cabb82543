"""A search that ranks its rungs by a checkpoint score (`tune.intermediate: checkpoint`), end to end on the tiny
model: each trial stops at its rung, scores its rung checkpoint on the objective's task before it stops, and the rung
promotes the trial whose checkpoint `checkpoint_scores.steps.score_at` ranks first. Plus the plan-time refusal of a
tuned cell that sets its own checkpoint evaluation (the other bad `tune.intermediate` values are in
test_tune_plan.py's table)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import write
from processes import run_exp

from tunelab import plan
from tunelab.checkpoint_scores.steps import score_at
from tunelab.core.files import read_json, read_jsonl
from tunelab.folders.cell import CellFolder
from tunelab.run.launch import STOP_AT_ENV

MATRIX = """name: tc
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  train: {steps: 6, batch_size: 4, warmup_steps: 1}
  eval: {tasks: [val_loss], val_batches: 2}
  tracking: {wandb: false}
tune:
  space: {optim.lr: {log_uniform: [1.0e-4, 1.0e-1]}}
  trials: 3
  metric: val_loss
  pruner: halving
  min_steps: 2
  intermediate: checkpoint
"""


@pytest.mark.parametrize("method", ["none", "lora"])
def test_halving_on_a_checkpoint_score_promotes_what_score_at_ranks_first(tmp_path, method):
    """Full fine-tuning: each trial its own process, scoring its rung checkpoint itself; LoRA: the trials in one
    together-group, their rung checkpoints scored over its base in shared passes (checkpoint_scores/shared.py)."""
    path = write(tmp_path / "tc.yaml", MATRIX.replace("  tracking:", f"  peft: {{method: {method}}}\n  tracking:"))
    planned = run_exp("plan", path, "--json")
    assert [g["intermediate"] for g in json.loads(planned.stdout)["groups"]] == ["checkpoint"], planned.stdout
    done = run_exp("run", path, "--runs-dir", tmp_path / "runs", timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (table,) = [read_json(p) for p in (tmp_path / "runs" / "tc" / "tune").glob("*/trials.json")]
    assert table["intermediate"] == "val_loss at the rung checkpoint"
    got = run_exp("tune", "status", tmp_path / "runs" / "tc", "--json")
    (study,) = json.loads(got.stdout)  # trials.json's trials, with their folders
    assert study["decisions"] == table["decisions"] and study["complete"] == 1 and study["pruned"] == 2
    (decision,) = study["decisions"]
    assert decision["step"] == 2 and decision["by"].startswith("val_loss at the rung checkpoint (lowest first")
    recorded = {n: v for n, v in decision["values"]}
    scored = {}
    for t in study["trials"]:
        d = CellFolder(Path(t["dir"]))
        ck = d.config().checkpoint_eval_id()
        assert d.config().eval.checkpoints.at == [2] and d.config().eval.checkpoints.workers == 0
        step = d.step_results(ck, 2)
        # scored by the trial itself, paused at its rung, before the decision; the score is what the search read
        assert step["complete"] and step["evaluated_by"] == ("the cell, paused at step 2" if method == "none" else
                                                             "the together-group, in shared passes with 3 adapters, "
                                                             "paused at step 2")
        scored[t["number"]] = score_at(d, 2, "val_loss", ck)
        assert scored[t["number"]] == recorded[t["number"]] == t["intermediate"]["2"]
        # the checkpoint's score is the validation loss of the step-2 weights, as the loop measured it there
        loop = next(r["val_loss"] for r in read_jsonl(d.path / "train" / "metrics.jsonl") if r["step"] == 2)
        assert abs(scored[t["number"]] - loop) < 1e-5, (scored, loop)
    assert len(set(scored.values())) == 3  # three learning rates, three scores: the ranking is not a tie
    best = min(scored, key=lambda n: (scored[n], n))
    assert decision["promoted"] == [best]
    for t in study["trials"]:
        assert t["state"] == ("complete" if t["number"] == best else "pruned")
        assert t["reached"] == (6 if t["number"] == best else 2)


def test_a_checkpoint_intermediate_over_a_cells_own_checkpoint_evaluation_exits_2(cli, tmp_path):
    text = MATRIX.replace("eval: {tasks: [val_loss], val_batches: 2}",
                          "eval: {tasks: [val_loss], val_batches: 2, checkpoints: {every: 3}}")
    path = write(tmp_path / "own.yaml", text)
    code, _, err = cli("run", path, "--runs-dir", tmp_path / "runs")
    said = " ".join(err.split())
    assert code == 2 and f"{path}: tune.intermediate" in said and "sets eval.checkpoints itself" in said, said
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


def test_a_trial_killed_while_it_scores_its_rung_scores_it_when_started_again(tmp_path):
    """What a kill during the rung's evaluation leaves (the checkpoint of the rung, no step folder: a step is
    renamed into place only once complete) is scored by the next start: it resumes past its rung, stops at once
    and evaluates the checkpoint."""
    raw = yaml.safe_load(MATRIX.split("tune:")[0])["base"]
    raw["eval"]["checkpoints"] = {"at": [2], "workers": 0}
    cell = tmp_path / "cell"
    cell.mkdir()
    (cell / "config.yaml").write_text(yaml.safe_dump(plan.cell_config(raw).model_dump(mode="json")))
    env = {**os.environ, STOP_AT_ENV: "2"}

    def start() -> dict:
        done = subprocess.run([sys.executable, "-m", "tunelab.cell", str(cell)], check=False, capture_output=True,
                              text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        d = CellFolder(cell)
        assert d.status()["paused_at"] == 2 and (cell / "checkpoints" / "step-2").is_dir()
        return d.step_results(d.config().checkpoint_eval_id(), 2)

    first = start()
    shutil.rmtree(CellFolder(cell).step_dir(CellFolder(cell).config().checkpoint_eval_id(), 2))  # the kill
    again = start()
    assert again["complete"] and again["evaluated_by"] == "the cell, paused at step 2"
    assert again["tasks"]["val_loss"]["value"] == first["tasks"]["val_loss"]["value"]
    steps = [r["step"] for r in read_jsonl(cell / "train" / "metrics.jsonl")]
    assert steps == [1, 2]  # nothing trained twice, nothing past the rung
