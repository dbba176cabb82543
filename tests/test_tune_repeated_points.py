"""A search over a discrete space draws the same point twice (here trials 1 and 2 of a 2-value choice): both
trials are one cell. When the twin that ties is pruned at the rung, the cell goes on for the promoted one and wins:
it is not let go (checkpoints deleted, status rewritten to pending "pruned"), `exp status` says done, a second
`exp run` starts nothing, and the search's steps count the cell's steps once."""

from __future__ import annotations

import json

from conftest import write
from processes import attempts, run_exp

from tunelab.core.files import read_json
from tunelab.folders.cell import CellFolder

MATRIX = """name: dup
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  train: {steps: 3, batch_size: 4, warmup_steps: 1}
  eval: {tasks: [val_loss], val_batches: 1}
  tracking: {wandb: false}
tune:
  space: {optim.lr: {choice: [1.0e-4, 3.0e-3]}}
  trials: 3
  pruner: halving
  eta: 3
  min_steps: 1
  seed: 1
"""


def test_a_point_drawn_twice_is_one_cell_and_its_pruned_twin_does_not_free_the_winner(tmp_path):
    path, runs = write(tmp_path / "dup.yaml", MATRIX), tmp_path / "runs"
    done = run_exp("run", path, "--runs-dir", runs, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (trials_file,) = (runs / "dup" / "tune").glob("*/trials.json")
    table = read_json(trials_file)
    trials = {t["number"]: t for t in table["trials"]}
    assert trials[1]["cell"] == trials[2]["cell"] != trials[0]["cell"]  # seed 1 draws 1e-4, 3e-3, 3e-3
    assert (trials[1]["state"], trials[2]["state"]) == ("complete", "pruned")  # the tie: the lower number goes on
    assert table["summary"]["search_steps"] == 1 + 3  # trial 0 to its rung, the twins' one cell to the end
    (winner,) = [p for p in (runs / "dup").iterdir() if p.name.endswith(trials[1]["cell"])]
    folder = CellFolder(winner)
    assert folder.status()["state"] == "done" and "pruned" not in folder.status().get("note", "")
    assert folder.checkpoint_steps(), "the winner's checkpoints were deleted as a pruned trial's"
    shown = run_exp("status", runs / "dup", "--json")
    rows = {r["id"]: r for r in json.loads(shown.stdout)}
    assert rows[trials[1]["cell"]]["state"] == "done", rows
    before = attempts(winner)
    again = run_exp("run", path, "--runs-dir", runs, timeout=900)
    assert again.returncode == 0 and attempts(winner) == before, again.stdout[-2000:]
