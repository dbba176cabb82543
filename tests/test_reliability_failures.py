"""A cell that dies gets its cause, and the matrix goes on: a cell killed by SIGKILL (what the kernel's OOM killer
sends) is `interrupted` and the next plain `exp run` resumes it (README: killed cells are interrupted); one that
crashes in native code (SIGSEGV) is failed, with the signal's name and the last lines of its cell.log in status.json
and in `exp status`, and `--rerun-failed` runs it again; the finished cell is left alone. Also the pieces: exit
statuses in words, the log's tail."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys

import pytest
from conftest import write
from processes import attempts, run_exp, wait_for

from tunelab.core.files import read_json, read_jsonl
from tunelab.folders.cell import CellFolder
from tunelab.matrix import expansion
from tunelab.run.outcome import exit_cause

MATRIX = """name: dies
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  train: {steps: 30, batch_size: 2}
  eval: {tasks: [val_loss], val_batches: 1}
  tracking: {wandb: false}
matrix:
  train.steps: [30, 31, 2]
"""


@pytest.fixture
def no_core_dumps():
    """The crash below must not leave a core file behind: the processes started meanwhile inherit the limit."""
    before = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, before[1]))
    yield
    resource.setrlimit(resource.RLIMIT_CORE, before)


def test_a_killed_cell_is_interrupted_and_resumed_a_crashed_one_failed_and_rerun_on_request(tmp_path, no_core_dumps):
    path = write(tmp_path / "dies.yaml", MATRIX)
    runs = tmp_path / "runs"
    killed, crashed, fine = (runs / "dies" / c.dirname for c in expansion.load(path)[1])
    log = tmp_path / "run.log"
    proc = subprocess.Popen([sys.executable, "-m", "tunelab.cli", "run", str(path), "--runs-dir", str(runs)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "COLUMNS": "250"})
    for cell, sig in ((killed, signal.SIGKILL), (crashed, signal.SIGSEGV)):
        pid = wait_for(lambda c=cell: read_jsonl(c / "train" / "metrics.jsonl")
                       and (read_json(c / "status.json") or {}).get("pid"), f"{cell.name} to train", proc)
        os.kill(pid, sig)
    assert proc.wait(timeout=600) == 1, log.read_text()[-3000:]  # not 130: the runner itself got no signal
    text = " ".join(log.read_text().split())
    assert "Traceback" not in text

    status = read_json(killed / "status.json")
    assert status["state"] == "pending" and status["note"].startswith("interrupted: cell process killed by SIGKILL")
    assert "out-of-memory killer" in status["note"] and status["exit"].startswith("killed by SIGKILL")
    assert status["log_tail"] and " starts: " in status["log_tail"][0]  # the attempt's own first line
    assert f"{killed.name} was killed (interrupted: cell process killed by SIGKILL" in text
    assert "resumes it from its last checkpoint" in text
    status = read_json(crashed / "status.json")
    assert status["state"] == "failed" and status["error"].startswith("cell process killed by SIGSEGV")
    assert status["exit"].startswith("killed by SIGSEGV") and " starts: " in status["log_tail"][0]
    assert f"{crashed.name} failed: cell process killed by SIGSEGV" in text
    assert read_json(fine / "status.json")["state"] == "done"  # the matrix went on after both

    shown = run_exp("status", runs / "dies")
    assert shown.returncode == 0
    table = " ".join(shown.stdout.split())
    assert "killed by SIGKILL" in table and "killed by SIGSEGV" in table and "last lines of" in table
    rows = {r["dir"]: r for r in json.loads(run_exp("status", runs / "dies", "--json").stdout)}
    assert rows[str(killed)]["state"] == "interrupted" and rows[str(crashed)]["state"] == "failed"
    assert rows[str(crashed)]["log_tail"] and rows[str(fine)]["state"] == "done"

    before = (fine / "train" / "metrics.jsonl").stat().st_mtime_ns
    again = run_exp("run", path, "--runs-dir", runs)  # a plain run resumes the killed cell, not the crashed one
    assert again.returncode == 1 and "failed, skipped" in again.stderr and "--rerun-failed" in again.stderr
    assert read_json(killed / "status.json")["state"] == "done" and attempts(killed) == 2
    assert attempts(crashed) == 1
    again = run_exp("run", path, "--runs-dir", runs, "--rerun-failed")
    assert again.returncode == 0, again.stderr[-3000:]
    for cell in (killed, crashed):
        status = read_json(cell / "status.json")
        assert status["state"] == "done" and attempts(cell) == 2  # stopped once, run again once
        assert not {"error", "exit", "log_tail", "note"} & set(status)  # the end of an earlier attempt is gone
    assert attempts(fine) == 1 and (fine / "train" / "metrics.jsonl").stat().st_mtime_ns == before


def test_exit_statuses_in_words():
    assert exit_cause(-9).startswith("killed by SIGKILL: usually the kernel's out-of-memory killer")
    assert exit_cause(137).startswith("killed by SIGKILL")  # a shell's 128 + 9
    assert exit_cause(-11).startswith("killed by SIGSEGV: usually a crash in native code")
    assert exit_cause(-15).startswith("killed by SIGTERM")
    assert exit_cause(1) == "exited with code 1"
    assert exit_cause(2) == "exited with code 2"
    # torchrun exits 1 when a worker dies; the worker's own status is in torchrun's report in the log
    report = ["[2026-01-01] torch.distributed.elastic...ChildFailedError:", "  exitcode  : -9 (pid: 4242)"]
    assert exit_cause(1, report) == ("killed by SIGKILL: usually the kernel's out-of-memory killer (see `dmesg`), "
                                     "the batch system or a user (a worker process; torchrun exited with code 1)")


def test_the_log_tail_is_the_last_lines_of_a_long_log(tmp_path):
    lines = [f"line {i} " + "x" * (i % 50) for i in range(20000)]  # longer than the 64 KiB read
    (tmp_path / "cell.log").write_text("\n".join(lines) + "\n\n")
    assert CellFolder(tmp_path).log_tail() == lines[-20:]
    assert CellFolder(tmp_path / "nowhere").log_tail() == []
