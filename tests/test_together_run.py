"""Together-groups through `exp run` (#46, run/groups.py, run/workers.py): the runner plans the groups, locks each
member's folder and hands the locks to the group's process, follows each member's events as a cell's, and ends with
an outcome per member. Against `--together off` (every cell its own process): the same numbers bit for bit; a member
locked elsewhere comes back later and runs alone; a group's process killed -9 leaves each member interrupted with the
cause (as a killed cell), and the next plain `exp run` resumes them, alone, from their checkpoints."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import write
from processes import attempts, run_exp, start_exp, wait_for

from tunelab.core.files import read_json, read_jsonl
from tunelab.core.locks import CellLock, is_locked
from tunelab.folders.cell import OWN_TIMINGS, CellFolder
from tunelab.matrix import expansion

MATRIX = """name: NAME
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  peft: {method: lora, dropout: 0.1}
  train: {steps: STEPS, batch_size: 2, warmup_steps: 1, save_every: 3}
  eval: {tasks: [val_loss], val_batches: 1}
  tracking: {wandb: false}
matrix:
  optim.lr: [1.0e-3, 3.0e-3, 1.0e-2]
include:
  - {peft.method: none, optim.lr: 1.0e-5}
"""


def matrix_file(tmp_path, name: str, steps: int = 4):
    path = write(tmp_path / f"{name}.yaml", MATRIX.replace("NAME", name).replace("STEPS", str(steps)))
    return path, [tmp_path / "runs" / name / c.dirname for c in expansion.load(path)[1]]


def numbers(d) -> list:
    return [(r["step"], r["loss"], r.get("grad_norm"), r.get("val_loss"))
            for r in read_jsonl(d / "train" / "metrics.jsonl")]


@pytest.fixture(scope="module")
def apart(tmp_path_factory):
    """The matrix with every cell in its own process (the reference)."""
    tmp = tmp_path_factory.mktemp("apart")
    path, cells = matrix_file(tmp, "tr")
    done = run_exp("run", path, "--runs-dir", tmp / "runs", "--together", "off", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return {c.name: numbers(c) for c in cells}


def test_a_matrix_runs_its_lora_cells_as_one_group_with_the_numbers_of_separate_processes(apart, tmp_path):
    path, cells = matrix_file(tmp_path, "tr")
    done = run_exp("run", path, "--runs-dir", tmp_path / "runs", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lora, (full,) = cells[:3], cells[3:]
    pids = {read_json(d / "status.json")["together"]["pid"] for d in lora}
    assert len(pids) == 1 and read_json(full / "status.json").get("together") is None  # one process; full alone
    for d in cells:
        assert read_json(d / "status.json")["state"] == "done" and attempts(d) == 1 and not is_locked(d)
        assert numbers(d) == apart[d.name]
    log = " ".join(done.stderr.split())
    for d in lora:  # each member's own progress lines and end, as a cell's
        slug = CellFolder(d).meta()["slug"]
        assert f"{slug}: started" in log and f"{slug}: done after" in log
    for d in lora:  # a member's cost is its own part of the group's run: less than the run's wall time
        (ended,) = CellFolder(d).attempts()
        parts = read_json(d / "status.json")["timings"]
        assert ended["seconds"] == round(sum(parts.get(k, 0.0) for k in OWN_TIMINGS), 3) < ended["wall_s"]
    record = read_json(next((tmp_path / "runs" / "tr" / ".together").glob("*/record.json")))
    assert record["states"] == {"0": "done", "1": "done", "2": "done"} and record["peak_mb"] > 0
    import csv

    rows = {r["cell"]: r for r in csv.DictReader((tmp_path / "runs" / "tr" / "leaderboard.csv").open())}
    tagged = {cell for cell, r in rows.items() if r["notes"] == "peak-MB-of-together-group"}
    assert len(tagged) == 3 and rows.keys() - tagged == {CellFolder(full).meta()["slug"]}  # the CSV says it too


def test_a_member_locked_elsewhere_comes_back_later_and_runs_alone(apart, tmp_path):
    path, cells = matrix_file(tmp_path, "tr")
    locked = cells[1]
    holder = CellLock(locked)
    assert holder.acquire()
    proc = start_exp("run", path, "--runs-dir", tmp_path / "runs", log=tmp_path / "run.log")
    log = tmp_path / "run.log"
    wait_for(lambda: "waiting for the process that holds its lock" in log.read_text(), "the runner waits", proc)
    assert read_json(cells[0] / "status.json")["together"]["members"] == 2  # the other two went on together
    holder.release()
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert read_json(locked / "status.json").get("together") is None  # alone, once its lock was free
    for d in cells:
        assert attempts(d) == 1 and numbers(d) == apart[d.name]


def test_a_killed_group_process_interrupts_each_member_and_they_resume_alone(tmp_path):
    path, cells = matrix_file(tmp_path, "tk", steps=40)
    lora = cells[:3]
    proc = start_exp("run", path, "--runs-dir", tmp_path / "runs", log=tmp_path / "run.log")
    pid = wait_for(lambda: all(CellFolder(d).checkpoint_steps() for d in lora)
                   and read_json(lora[0] / "status.json")["pid"], "the group past its first checkpoints", proc)
    os.kill(pid, signal.SIGKILL)
    assert proc.wait(timeout=600) != 0, (tmp_path / "run.log").read_text()[-3000:]
    for d in lora:
        status = read_json(d / "status.json")
        assert status["state"] == "pending" and status["note"].startswith(
            "interrupted: its together-group's process killed by SIGKILL"), status
        assert status["log_tail"] and status["together"]["pid"] == pid and status["group_died"]
    again = run_exp("run", path, "--runs-dir", tmp_path / "runs", timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    for d in lora:  # alone now, each from its last checkpoint
        status = read_json(d / "status.json")
        assert status["state"] == "done" and status.get("together") is None and attempts(d) == 2
        assert read_json(d / "train" / "summary.json")["resumed_from"] is not None
        assert [r["step"] for r in read_jsonl(d / "train" / "metrics.jsonl")] == list(range(1, 41))
