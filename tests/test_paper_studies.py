"""The CoLLiE studies in experiments/: each plans as written (a GPU cluster's matrix plans on any machine) and
with the CPU stand-in its header gives; a small matrix run twice in fresh folders gives identical scores."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest
from conftest import REPO, write

STUDIES = ["paper_instruction_tuning", "paper_memory", "paper_throughput"]


def stand_in_args(study: str) -> list[str]:
    """The --set arguments of the stand-in command in the study file's header comment."""
    lines = (REPO / "experiments" / f"{study}.yaml").read_text().splitlines()
    header = "".join(line[1:].strip() + " " for line in lines if line.startswith("#"))
    command = re.search(r"exp run experiments/" + study + r"\.yaml (.*?)(?:\(|$)", header.replace("\\ ", ""))
    assert command, f"{study}.yaml has no stand-in command in its header"
    return shlex.split(command.group(1))


@pytest.mark.parametrize("study", STUDIES)
def test_each_study_plans_as_written_and_as_its_stand_in(cli, study):
    path = REPO / "experiments" / f"{study}.yaml"
    code, out, err = cli("plan", path, "--json")
    assert code == 0, err
    cells = json.loads(out)
    assert len(cells) >= 6
    code, out, err = cli("plan", path, "--json", *stand_in_args(study))
    assert code == 0, err
    small = json.loads(out)
    assert small and all(c["config"]["model"]["name"] == "tiny-random-llama" for c in small)


def test_the_instruction_tuning_study_covers_the_papers_grid(cli):
    code, out, _ = cli("plan", REPO / "experiments" / "paper_instruction_tuning.yaml", "--json")
    cells = json.loads(out)
    optims = {c["config"]["optim"]["name"] for c in cells if c["config"]["peft"]["method"] == "none"}
    peft = {c["config"]["peft"]["method"] for c in cells}
    assert optims == {"adamw", "lion", "adan", "sophiag", "lomo", "adalomo"}
    assert peft == {"none", "lora", "prefix", "prompt", "p_tuning"}
    assert {c["config"]["eval"]["suite"] for c in cells} == {"paper"}
    assert {c["config"]["train"]["seed"] for c in cells} == {0, 1, 2}


def test_a_matrix_run_twice_in_fresh_folders_gives_identical_scores(tmp_path):
    path = write(tmp_path / "rep.yaml", """name: rep
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 64}
  optim: {lr: 1.0e-3}
  train: {steps: 3, batch_size: 2}
  eval: {tasks: [val_loss, gsm8k_smoke, humaneval], limit: 2, max_new_tokens: 8, val_batches: 2}
  tracking: {wandb: false}
matrix:
  peft.method: [none, lora]
""")
    boards = []
    for run in ("first", "second"):
        runs = tmp_path / run
        proc = subprocess.run([sys.executable, "-m", "tunelab.cli", "run", str(path), "--runs-dir", str(runs)],
                              check=False, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-2000:]
        board = json.loads((runs / "rep" / "leaderboard.json").read_text())
        boards.append({r["cell"]: {name: (c["mean"], c["spread"], c["n"]) for name, c in r["columns"].items()
                                   if c["kind"] == "score" or name == "train loss"} for r in board["rows"]})
    assert boards[0] == boards[1]
    assert set(boards[0]) == {"none", "lora"} and boards[0]["none"]["val_loss"][0] > 0
