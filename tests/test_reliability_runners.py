"""Two runners on one matrix, and a runner killed under a live cell: no cell ever runs twice, every runner
ends with every cell done, a cell locked elsewhere is waited for, and a lock whose holder died is taken over
(the kernel freed it; the status it left saying "running" does not block anyone)."""

from __future__ import annotations

import os
import signal

from conftest import write
from processes import attempts, pid_alive, run_exp, start_exp, wait_for

from tunelab.core.files import read_json, read_jsonl
from tunelab.core.locks import CellLock, is_locked
from tunelab.folders.cell import CellFolder
from tunelab.matrix import expansion

MATRIX = """name: NAME
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  train: {steps: STEPS, batch_size: 2}
  eval: {tasks: [val_loss], val_batches: 1}
  tracking: {wandb: false}
matrix:
  peft.method: [AXIS]
"""


def matrix_file(tmp_path, name: str, axis: str = "none, lora", steps: int = 2):
    path = write(tmp_path / f"{name}.yaml", MATRIX.replace("NAME", name).replace("AXIS", axis)
                 .replace("STEPS", str(steps)))
    return path, [tmp_path / "runs" / name / c.dirname for c in expansion.load(path)[1]]


def assert_done_once(cell_dir, steps: int = 2):
    assert read_json(cell_dir / "status.json")["state"] == "done"
    assert attempts(cell_dir) == 1, (cell_dir / "cell.log").read_text()[-2000:]
    assert [r["step"] for r in read_jsonl(cell_dir / "train" / "metrics.jsonl")] == list(range(1, steps + 1))


def test_two_runners_at_once_run_each_cell_once_and_both_end_done(tmp_path):
    path, cells = matrix_file(tmp_path, "race")
    a = start_exp("run", path, "--runs-dir", tmp_path / "runs", log=tmp_path / "a.log")
    b = start_exp("run", path, "--runs-dir", tmp_path / "runs", log=tmp_path / "b.log")
    for proc, log in ((a, "a.log"), (b, "b.log")):
        assert proc.wait(timeout=600) == 0, (tmp_path / log).read_text()[-3000:]
    for cell in cells:
        assert_done_once(cell)
    both = (tmp_path / "a.log").read_text() + (tmp_path / "b.log").read_text()
    assert "Traceback" not in both and "failed" not in both


def test_a_cell_locked_elsewhere_is_waited_for_and_taken_over_when_its_holder_dies(tmp_path):
    """The test holds the lock as another runner would, with a status saying running; `exp run` goes on with
    the other cell, waits, and when the holder lets go without finishing (it died), runs the cell itself."""
    path, (locked, free) = matrix_file(tmp_path, "wait")
    holder = CellLock(locked)
    assert holder.acquire()
    CellFolder(locked).write_status("running", pid=os.getpid())
    proc = start_exp("run", path, "--runs-dir", tmp_path / "runs", log=tmp_path / "run.log")
    log = tmp_path / "run.log"
    wait_for(lambda: "waiting for the process that holds its lock" in log.read_text(), "the runner waits", proc)
    assert read_json(free / "status.json")["state"] == "done"  # it went on with the free cell first
    assert f"pid {os.getpid()}" in log.read_text() and "(running)" in log.read_text()  # named the holder
    assert read_json(locked / "status.json")["state"] == "running" and attempts(locked) == 0
    holder.release()  # the holder is gone; its "running" stays behind
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    text = " ".join(log.read_text().split())
    assert "its lock is free and it is not done: running it here" in text
    for cell in (locked, free):
        assert_done_once(cell)


def test_a_cell_outlives_its_killed_runner_and_the_next_runner_waits_for_it(tmp_path):
    """kill -9 of the runner alone: its cell goes on holding the folder's lock (it inherited it), so the next
    `exp run` does not start the cell a second time; it waits and reports it done by another process."""
    path, (cell,) = matrix_file(tmp_path, "orphan", axis="lora", steps=30)
    first = start_exp("run", path, "--runs-dir", tmp_path / "runs", log=tmp_path / "first.log")
    pid = wait_for(lambda: (read_json(cell / "status.json") or {}).get("pid"), "the cell to start", first)
    wait_for(lambda: read_jsonl(cell / "train" / "metrics.jsonl"), "the cell to train", first)
    os.kill(pid, signal.SIGSTOP)  # hold the cell still so the test does not race it
    try:
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
        assert pid_alive(pid) and is_locked(cell) and read_json(cell / "status.json")["state"] == "running"
        second = start_exp("run", path, "--runs-dir", tmp_path / "runs", log=tmp_path / "second.log")
        log = tmp_path / "second.log"
        wait_for(lambda: "waiting for the process that holds its lock" in log.read_text(), "the wait", second)
        said = " ".join(log.read_text().split())  # the runner is gone, the cell it started is stopped: said
        assert f"(gone); cell process pid {pid} (stopped: `kill -CONT {pid}` lets it go on" in said
    finally:
        os.kill(pid, signal.SIGCONT)
    assert second.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert "done by another process" in log.read_text()
    assert_done_once(cell, steps=30)
    status = run_exp("status", tmp_path / "runs" / "orphan")
    assert status.returncode == 0 and "done" in status.stdout
