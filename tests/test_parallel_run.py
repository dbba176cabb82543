"""`exp run` of a 2-process cell (torchrun, FSDP2 dp2): same losses as one process, and resume from an
engine checkpoint gives the same per-step losses."""

from __future__ import annotations

import json
import shutil

from conftest import write

from tunelab.core.files import read_jsonl
from tunelab.folders.cell import CellFolder

MATRIX = """name: par
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 96}
  optim: {lr: 1.0e-3}
  train: {steps: 4, batch_size: 4, warmup_steps: 1, save_every: 2, keep_checkpoints: 2}
  eval: {tasks: [val_loss], val_batches: 2}
  tracking: {wandb: false}
matrix:
  parallel.dp: [1, 2]
"""


def losses(cell_dir):
    return [r["loss"] for r in read_jsonl(cell_dir / "train" / "metrics.jsonl")]


def test_two_process_cell_matches_one_process_and_resumes(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = write(tmp_path / "par.yaml", MATRIX)
    runs = tmp_path / "runs"
    code, _, err = cli("run", path, "--runs-dir", runs)
    assert code == 0, err
    one, two = (next((runs / "par").glob(f"dp{n}-*")) for n in (1, 2))
    assert json.loads((two / "status.json").read_text())["world_size"] == 2
    ref = losses(one)
    assert len(ref) == 4
    assert max(abs(a - b) for a, b in zip(ref, losses(two))) < 1e-4
    summary = json.loads((two / "train" / "summary.json").read_text())
    assert summary["world_size"] == 2 and abs(summary["val_loss"] - json.loads(
        (one / "train" / "summary.json").read_text())["val_loss"]) < 1e-4
    assert (two / "final" / "model.safetensors").is_file()
    assert (two / "checkpoints" / "step-2" / "engine").is_dir()

    # As if the run had died after its step-2 checkpoint: the next `exp run` resumes from it. (A cell that
    # died in training never wrote `trained`; a trained one would only be evaluated again.)
    shutil.rmtree(two / "checkpoints" / "step-4")
    CellFolder(two).write_status("running", trained=False)
    code, _, err = cli("run", path, "--runs-dir", runs, "--only", "dp2")
    assert code == 0, err
    assert max(abs(a - b) for a, b in zip(ref, losses(two))) < 1e-4
    assert json.loads((two / "train" / "summary.json").read_text())["resumed_from"] == 2
    assert [r["step"] for r in read_jsonl(two / "train" / "metrics.jsonl")] == [1, 2, 3, 4]
