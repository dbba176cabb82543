"""Faults a run survives (issue 53), injected into real runs of the tiny model: full disks (a tmpfs of its own),
`ulimit -f`, corrupted and missing files, stopped processes holding locks, two matrix files of one name. Each
test says what must hold: never a silently wrong result, never a wait without a word, never a traceback.

docs/RELIABILITY.md ("Faults injected") lists each fault with the test here that shows it."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from conftest import fill, write
from processes import WAIT_S, attempts, kill_group, run_exp, start_exp, wait_for

from tunelab.core.errors import UserError
from tunelab.core.files import WriteFailed, read_json, read_jsonl, write_json
from tunelab.core.locks import CellLock, holder, process_state
from tunelab.folders.cell import CellFolder
from tunelab.run.outcome import killed_from_outside
from tunelab.run.runner import settle
from tunelab.train import checkpoint

MATRIX = """name: faults
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  train: {steps: 12, batch_size: 2, save_every: 4, keep_checkpoints: 3}
  eval: {tasks: [val_loss], val_batches: 1}
  tracking: {wandb: false}
"""
MB = 1 << 20


def losses(cell: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_jsonl(cell / "train" / "metrics.jsonl")]


def val_loss(cell: Path) -> float:
    (res,) = cell.glob("eval/*/results.json")
    return read_json(res)["tasks"]["val_loss"]["value"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """MATRIX run once, uninterrupted: the numbers every resumed run must end with."""
    tmp = tmp_path_factory.mktemp("faults")
    path = write(tmp / "faults.yaml", MATRIX)
    done = run_exp("run", path, "--runs-dir", tmp / "runs")
    assert done.returncode == 0, done.stderr[-3000:]
    (cell,) = (tmp / "runs" / "faults").glob("faults-*")
    return path, cell


def copy_run(finished, tmp_path: Path) -> tuple[Path, Path]:
    """The finished run folder copied: (matrix file, the cell's folder)."""
    path, cell = finished
    shutil.copytree(cell.parent, tmp_path / "runs" / "faults")
    return path, tmp_path / "runs" / "faults" / cell.name


def as_killed(cell: Path) -> None:
    """The cell as a kill -9 after its last checkpoint leaves it: no final/, no evaluation, status running."""
    shutil.rmtree(cell / "final")
    shutil.rmtree(cell / "eval")
    status = read_json(cell / "status.json")
    (cell / "status.json").write_text(json.dumps({**status, "state": "running", "trained": False}))


def run_limited(*args, fsize: int) -> subprocess.CompletedProcess:
    """`exp ARGS` under `ulimit -f` (RLIMIT_FSIZE, bytes): the runner and the cells it starts inherit it."""
    return subprocess.run([sys.executable, "-m", "tunelab.cli", *map(str, args)], check=False, text=True,
                          capture_output=True, timeout=WAIT_S, env={**os.environ, "COLUMNS": "250"},
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize)))


# -- a checkpoint is complete or it is not used -------------------------------------------------------------------

def test_a_checkpoints_manifest_names_every_kind_of_damage(finished, tmp_path):
    _, cell = finished
    good = cell / "checkpoints" / "step-8"
    assert checkpoint.incomplete(good) is None
    listed = read_json(good / "manifest.json")["files"]
    assert set(listed) == {"model.pt", "optimizer.pt", "state.pt"}  # every file the resume reads

    def damaged(name: str, harm) -> str | None:
        ck = shutil.copytree(good, tmp_path / name)
        harm(ck)
        return checkpoint.incomplete(ck)

    assert damaged("missing", lambda ck: (ck / "optimizer.pt").unlink()) == "optimizer.pt is missing"
    cut = damaged("cut", lambda ck: (ck / "model.pt").write_bytes((ck / "model.pt").read_bytes()[:1000]))
    size = listed["model.pt"]["size"]
    assert cut == f"model.pt has 1000 bytes where its manifest says {size} (cut short or changed since)"

    def flip(ck: Path) -> None:  # the same size, one byte changed: only the hash tells
        data = bytearray((ck / "state.pt").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (ck / "state.pt").write_bytes(bytes(data))

    assert damaged("flipped", flip) == ("state.pt is not the file that was written (its SHA-256 differs from the "
                                        "manifest's)")
    assert "has no manifest.json" in damaged("unlisted", lambda ck: (ck / "manifest.json").unlink())
    assert "manifest.json is unreadable" in damaged("garbled", lambda ck: (ck / "manifest.json").write_bytes(b"\xff{"))


def test_a_checkpoint_missing_its_optimizer_is_named_and_skipped_for_the_previous_complete_one(finished, tmp_path):
    """Issue 53, 1: `optimizer.pt` deleted from the newest checkpoint was not noticed (the optimizer restarted from
    zero under "resumed from step-12"). Now that checkpoint is named and the run resumes from the one before it,
    ending with the uninterrupted run's numbers."""
    path, cell = copy_run(finished, tmp_path)
    as_killed(cell)
    shutil.rmtree(cell / "checkpoints" / "step-12")
    (cell / "checkpoints" / "step-8" / "optimizer.pt").unlink()
    done = run_exp("run", path, "--runs-dir", tmp_path / "runs")
    assert done.returncode == 0, done.stderr[-3000:]
    said = " ".join((done.stdout + done.stderr).split())
    assert "resumed from step-4 (not from step-8: optimizer.pt is missing)" in said
    assert f"checkpoint {cell / 'checkpoints' / 'step-8'} is incomplete and is not used: optimizer.pt is missing" \
        in (cell / "cell.log").read_text()
    assert losses(cell) == losses(finished[1]) and val_loss(cell) == val_loss(finished[1])


# -- a failed write says which limit it met; nothing half-written is used ---------------------------------------

def test_ulimit_f_during_a_checkpoint_fails_the_cell_saying_so_and_leaves_no_partial_checkpoint(finished, tmp_path):
    """Issue 53, 5: `ulimit -f` during a checkpoint ended in "enforce fail at inline_container.cc". model.pt
    (0.8 MB) fits under 1 MB, optimizer.pt (1.6 MB) does not."""
    path = write(tmp_path / "faults.yaml", MATRIX)
    done = run_limited("run", path, "--runs-dir", tmp_path / "runs", fsize=MB)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    (cell,) = (tmp_path / "runs" / "faults").glob("faults-*")
    status = read_json(cell / "status.json")
    assert status["state"] == "failed" and not status["bad_input"]
    assert status["write_failed"] == f"file larger than this process may write (ulimit -f): {MB} bytes"
    assert "cannot write the checkpoint of step 4" in status["error"]
    assert not list((cell / "checkpoints").iterdir())  # the partial folder was removed, nothing else is there


def test_final_is_built_beside_so_a_failed_write_leaves_no_half_model(finished, tmp_path):
    """Issue 53, 6: final/ was written in place (a kill left an empty final/). Under a file size limit that
    checkpoints fit (no save_every here) but the model's weights do not, final/ is never there half-made."""
    path = write(tmp_path / "faults.yaml", MATRIX.replace("save_every: 4, ", ""))
    done = run_limited("run", path, "--runs-dir", tmp_path / "runs", fsize=600_000)
    assert done.returncode == 1, done.stderr[-3000:]
    (cell,) = (tmp_path / "runs" / "faults").glob("faults-*")
    status = read_json(cell / "status.json")
    assert status["state"] == "failed" and "ulimit -f" in status["write_failed"], status
    assert not (cell / "final").exists() and not list(cell.glob(".final*"))


def test_a_full_disk_is_recorded_in_status_and_a_plain_rerun_resumes_to_equal_losses(finished, tmp_path, tmpfs):
    """Issue 53, 6: a full disk left status `running` with its cause unrecorded. On a 4 MiB tmpfs the first
    checkpoint (2.5 MB) fits and the second does not: the cell fails saying so, its partial checkpoint removed; with
    room again, a plain `exp run` (no --rerun-failed) resumes it and ends with the uninterrupted run's numbers."""
    runs = tmpfs(tmp_path / "runs", "size=4m")
    path = write(tmp_path / "faults.yaml", MATRIX)
    done = run_exp("run", path, "--runs-dir", runs)
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    (cell,) = (runs / "faults").glob("faults-*")
    status = read_json(cell / "status.json")
    assert status["state"] == "failed" and status["write_failed"] == "no space left on the device", status
    assert "cannot write the checkpoint of step 8" in status["error"]
    assert [p.name for p in (cell / "checkpoints").iterdir()] == ["step-4"]
    subprocess.run(["mount", "-o", "remount,size=64m", str(runs)], check=True)
    again = run_exp("run", path, "--runs-dir", runs)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step-4" in " ".join(again.stderr.split())
    assert losses(cell) == losses(finished[1]) and val_loss(cell) == val_loss(finished[1])


def test_a_full_disk_while_a_lock_file_is_written_is_the_paragraph(tmp_path, tmpfs):
    """Issue 53, 5: a bare `OSError: [Errno 28]` came out of the lock file's write."""
    where = tmpfs(tmp_path / "full", "size=64k")
    fill(where)
    with pytest.raises(WriteFailed, match="cannot write here: no space left on the device") as e:
        CellLock(where).acquire()
    assert str(where / ".lock") in str(e.value) and "--runs-dir" in str(e.value)


def test_a_read_only_cache_on_a_cache_miss_fails_the_cell_naming_TUNELAB_CACHE(tmp_path, tmpfs, monkeypatch, cli):
    """Issue 53, 5: a raw `OSError [Errno 30]` in every cell while `exp plan` passed; and with HOME unwritable the
    advice named --runs-dir rather than TUNELAB_CACHE."""
    cache = tmpfs(tmp_path / "cache", "ro,size=1m")
    path = write(tmp_path / "faults.yaml", MATRIX)
    done = run_exp("run", path, "--runs-dir", tmp_path / "runs", env={"TUNELAB_CACHE": str(cache)})
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    (cell,) = (tmp_path / "runs" / "faults").glob("faults-*")
    status = read_json(cell / "status.json")
    assert status["write_failed"] == "read-only file system" and "TUNELAB_CACHE" in status["error"], status
    home = tmpfs(tmp_path / "home", "ro,size=1m")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("TUNELAB_CACHE")
    code, _, err = cli("run", path, "--runs-dir", tmp_path / "runs2")
    said = " ".join(err.split())
    assert code == 2 and "read-only file system" in said and "TUNELAB_CACHE" in said and "--runs-dir" not in said
    assert not (tmp_path / "runs2").exists()


# -- every failure reported as what it was ---------------------------------------------------------------------

def test_a_cells_failing_start_up_is_a_failure_with_its_cause_not_an_interruption(tmp_path):
    """Issue 53, 4: with env.json unwritable (here a folder in its place) `exp run` said "interrupted", exited 130
    and left the cell pending on every rerun: the start-up ran outside the cell's error handling."""
    path = write(tmp_path / "faults.yaml", MATRIX)
    runs = tmp_path / "runs"
    (planned,) = json.loads(run_exp("plan", path, "--json").stdout)
    cell = runs / "faults" / f"{planned['slug']}-{planned['id']}"
    (cell / "env.json").mkdir(parents=True)
    done = run_exp("run", path, "--runs-dir", runs)
    said = " ".join((done.stdout + done.stderr).split())
    assert "interrupted" not in said and "Traceback" not in said, said[-3000:]
    assert "faults: failed: IsADirectoryError: [Errno 21] Is a directory" in said
    status = read_json(cell / "status.json")
    assert status["state"] == "failed" and "env.json" in status["error"], status
    # The report cannot read env.json either: said as the paragraph (exit 2), as for any state file
    assert done.returncode == 2 and f"{cell / 'env.json'}: cannot read this file: Is a directory" in said
    again = run_exp("run", path, "--runs-dir", runs)
    assert "failed, skipped" in again.stderr and attempts(cell) == 1


def test_a_cell_that_dies_before_it_says_it_runs_is_failed_and_only_a_kill_from_outside_is_interrupted(tmp_path):
    folder = CellFolder(tmp_path)
    folder.write_status("pending")  # as the runner leaves it before the cell process starts
    (tmp_path / "cell.log").write_text("ImportError: a library the cell needs\n")
    status = settle(folder, 1)
    assert status["state"] == "failed" and status["error"] == "cell process exited with code 1"
    folder.write_status("running")
    status = settle(folder, -signal.SIGKILL)  # the OOM killer, a user: README's "interrupted", a plain rerun
    assert status["state"] == "pending" and status["note"].startswith("interrupted: cell process killed by SIGKILL")
    assert folder.state() == "interrupted"
    folder.write_status("running")
    assert settle(folder, -signal.SIGSEGV)["state"] == "failed"  # a crash is a failure
    assert killed_from_outside(137) and killed_from_outside(-15) and not killed_from_outside(-6)
    assert killed_from_outside(1, ["  exitcode  : -9 (pid: 42)"])  # a torchrun worker's kill


# -- no wait without a word ------------------------------------------------------------------------------------

HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from tunelab.core.locks import CellLock
    held = CellLock(Path(sys.argv[1]), sys.argv[2])
    assert held.acquire()
    print("held", flush=True)
    time.sleep(600)
""")


def hold(folder: Path, name: str = ".lock") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), name], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_waiter_says_who_holds_a_lock_and_what_that_process_is_doing(tmp_path):
    proc = hold(tmp_path)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        wait_for(lambda: process_state(proc.pid) == "stopped", "the holder to stop")
        shown = holder(tmp_path / ".lock")
        assert f"pid {proc.pid} on " in shown
        pid = proc.pid
        assert f"(stopped: `kill -CONT {pid}` lets it go on, `kill {pid}` ends it and frees the lock)" in shown
        said: list[str] = []
        waiter = threading.Thread(target=lambda: CellLock(tmp_path).acquire_saying(said.append, "waiting"))
        waiter.start()
        wait_for(lambda: said, "the waiter to say whom it waits for", timeout=5)
        assert said[0].startswith(f"waiting (pid {proc.pid} on ") and f"(stopped: `kill -CONT {pid}`" in said[0]
        os.kill(proc.pid, signal.SIGCONT)  # a change of state is said again
        wait_for(lambda: len(said) > 1, "the waiter to see the holder run", timeout=5)
        assert said[1].endswith("(running))")
    finally:
        proc.kill()
        proc.wait()
    waiter.join(timeout=10)
    assert not waiter.is_alive()  # the kernel freed the dead holder's lock: the waiter has it
    assert process_state(proc.pid) == "gone"


TUNED = """name: tl
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  train: {steps: 6, batch_size: 2}
  eval: {tasks: [val_loss], val_batches: 1}
  tracking: {wandb: false}
tune:
  space: {optim.lr: {log_uniform: [1.0e-4, 1.0e-1]}}
  trials: 2
  pruner: halving
  min_steps: 2
"""


def test_a_runner_waiting_for_a_stopped_holder_of_the_search_lock_says_so(tmp_path):
    """Issue 53, 3: a runner stopped (SIGSTOP) while it holds runs/<matrix>/tune/.lock blocked another without a
    word ("6/6 cell(s) finished", then nothing). Now the waiting runner names it, and goes on once it is gone."""
    path = write(tmp_path / "tl.yaml", TUNED)
    tune = tmp_path / "runs" / "tl" / "tune"
    tune.mkdir(parents=True)
    holder_proc = hold(tune)
    os.kill(holder_proc.pid, signal.SIGSTOP)
    log = tmp_path / "run.log"
    runner = start_exp("run", path, "--runs-dir", tmp_path / "runs", log=log, env={"COLUMNS": "250"})
    try:
        wait_for(lambda: "waiting for the process that holds the search's lock" in log.read_text(),
                 "the runner to say it waits", runner)
        said = " ".join(log.read_text().split())
        assert f"waiting for the process that holds the search's lock {tune / '.lock'} (pid {holder_proc.pid} on " \
            in said and f"(stopped: `kill -CONT {holder_proc.pid}`" in said
        holder_proc.kill()
        holder_proc.wait()
        wait_for(lambda: list(tune.glob("*/trials.json")), "the search to go on")  # it may end meanwhile
    finally:
        holder_proc.kill()
        kill_group(runner) if runner.poll() is None else None


# -- one reader for every state file ---------------------------------------------------------------------------

DAMAGE = {  # file (relative to the cell, or to the run folder with ../), bytes, what the paragraph says
    "status_not_utf8": ("status.json", b'{"state": "done\xff"}', "is not UTF-8 text"),
    "status_wrong_shape": ("status.json", b"[1, 2]", "holds a JSON list where tunelab writes a JSON object"),
    "cells_not_utf8": ("../cells.json", b"\xfe\xff[]", "is not UTF-8 text"),  # `exp run` writes it again
    "cell_json_not_json": ("cell.json", b'{"id": ', "is not valid JSON"),
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_a_damaged_state_file_is_one_paragraph_naming_it_and_what_to_do(name, finished, tmp_path, cli):
    """Issue 53, 5: UnicodeDecodeError / AttributeError tracebacks from status, leaderboard, run and report."""
    rel, data, problem = DAMAGE[name]
    path, cell = copy_run(finished, tmp_path)
    damaged = (cell / rel).resolve()
    damaged.write_bytes(data)
    mdir = cell.parent
    for args in (("status", mdir), ("leaderboard", mdir), ("report", mdir), ("run", path, "--runs-dir", mdir.parent)):
        code, out, err = cli(*args)
        said = " ".join(err.split())
        assert "Traceback" not in out + err, (args, out, err)
        if args[0] == "run" and damaged.name == "cells.json":  # the run writes the matrix's index first: repaired
            assert code == 0 and read_json(damaged, list) is not None, err
            continue
        assert code == 2, (args, out, err)
        assert f"{damaged}: this file {problem}" in said and "delete it: the next `exp run`" in said, (args, said)
    if damaged.name == "cell.json":  # as the paragraph says: deleted, the next `exp run` writes it again
        damaged.unlink()
        code, _, err = cli("run", path, "--runs-dir", mdir.parent)
        assert code == 0 and read_json(damaged)["id"] == read_json(finished[1] / "cell.json")["id"], err


def test_damaged_results_and_metrics_lines_are_said_and_left_out(finished, tmp_path, cli, capsys):
    """results.json of bytes that are not UTF-8 reads as missing (it is evaluated again, said so); a damaged line
    in the middle of train/metrics.jsonl is left out with a warning naming it (`exp report` raised ValueError)."""
    path, cell = copy_run(finished, tmp_path)
    (res,) = cell.glob("eval/*/results.json")
    res.write_bytes(b"\xff\xfe" + res.read_bytes())
    metrics = cell / "train" / "metrics.jsonl"
    lines = metrics.read_bytes().split(b"\n")
    metrics.write_bytes(b"\n".join(lines[:3] + [b"\x00\x00garbage"] + lines[4:]))
    code, out, err = cli("report", cell.parent)
    assert code == 0 and "Traceback" not in out + err
    assert f"warning: {metrics}: line 4 is not JSON" in " ".join(err.split())
    code, out, err = cli("run", path, "--runs-dir", cell.parent.parent)
    assert code == 0, err
    assert f"{res} is not readable JSON: evaluating it again" in " ".join((out + err).split())
    assert read_json(res)["complete"]


def test_a_damaged_journal_line_is_named_by_readers_and_the_next_writer_rebuilds_the_study(tmp_path):
    """Issue 53, 5: a bad middle line in the Optuna journal was a traceback in `exp run` and `exp tune status`. The
    study is a record of the cells: the writer moves the journal aside, says so, and writes it again whole."""
    from optuna.distributions import FloatDistribution

    from tunelab.folders.matrix import MatrixFolder
    from tunelab.tune import record, status

    mdir = MatrixFolder(tmp_path / "tl")
    space = {"optim.lr": FloatDistribution(1e-4, 1e-1, log=True)}
    views = [record.TrialView(n, 0, {"optim.lr": 10.0 ** -(n + 2)}, f"cell{n}", {2: 5.0 - n}, "pruned", None, 2, 2)
             for n in range(3)]
    record.sync(record.open_storage("journal", mdir.path), "s", "minimize", space, views, {"tunelab": {}})
    write_json(mdir.studies_file, [{"group": "g", "study": "s", "storage": "journal", "trials_file": "tune/s/t.json"}])
    before = [(r["number"], r["state"], r["intermediate"]) for r in status.collect(mdir.path)[0]["trials"]]
    lines = mdir.journal_file.read_bytes().split(b"\n")
    mdir.journal_file.write_bytes(b"\n".join(lines[:2] + [b'{"op_code": 4, "worker_id": \xff'] + lines[3:]))
    with pytest.raises(UserError, match=r"optuna.journal: line 3 is not UTF-8 \(byte \d+\): the journal was damaged"):
        status.collect(mdir.path)
    said: list[str] = []
    record.repair_journal(mdir.path, said.append)
    assert len(said) == 1 and said[0].startswith(f"{mdir.journal_file}: line 3 is not UTF-8")
    assert said[0].endswith(f"the journal was moved aside to {mdir.damaged_journal_file} and its studies are written "
                            "again from the trials' cells")
    record.sync(record.open_storage("journal", mdir.path), "s", "minimize", space, views, {"tunelab": {}})
    assert [(r["number"], r["state"], r["intermediate"]) for r in status.collect(mdir.path)[0]["trials"]] == before


# -- one runs folder, one matrix file --------------------------------------------------------------------------

TWO = """name: samec
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  optim: {lr: LR}
  train: {steps: 2, batch_size: 2}
  eval: {tasks: [val_loss], val_batches: 1}
  tracking: {wandb: false}
"""


def test_two_matrix_files_of_one_name_never_share_a_runs_folder(tmp_path, cli):
    """Issue 53, 2: two files named `samec` run 2 s apart into one runs folder mixed their cells (the first one's
    leaderboard showed the other's cell, `exp status` listed it twice); run in turn, the second replaced
    matrix.yaml, cells.json and the leaderboard without a word."""
    a, b = (write(tmp_path / d / "samec.yaml", TWO.replace("LR", lr)) for d, lr in (("a", "1.0e-3"), ("b", "1.0e-2")))
    runs, mdir = tmp_path / "runs", tmp_path / "runs" / "samec"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [start_exp("run", f, "--runs-dir", runs, log=log) for f, log in zip((a, b), logs)]
    codes = [p.wait(timeout=WAIT_S) for p in procs]
    assert sorted(codes) == [0, 2], [log.read_text()[-2000:] for log in logs]
    won, lost = (a, b) if codes[0] == 0 else (b, a)
    refused = " ".join(logs[codes.index(2)].read_text().split())
    assert f"{lost}: the run folder {mdir} belongs to another matrix file, {won}" in refused
    assert "Traceback" not in refused
    (only,) = read_json(mdir / "cells.json")
    assert len(list(mdir.glob("*/cell.json"))) == 1 and read_json(mdir / "source.json")["file"] == str(won)
    assert [r["cell"] for r in json.loads((mdir / "leaderboard.json").read_text())["rows"]] == [only["slug"]]

    before = {p: p.read_bytes() for p in mdir.rglob("*") if p.is_file() and p.name != ".lock"}
    code, _, err = cli("plan", lost, "--runs-dir", runs)  # at plan time too
    assert code == 2 and f"belongs to another matrix file, {won}" in " ".join(err.split())
    code, _, err = cli("run", lost, "--runs-dir", runs)  # in turn: refused the same way, nothing written
    assert code == 2 and f"belongs to another matrix file, {won}" in " ".join(err.split())
    assert {p: p.read_bytes() for p in mdir.rglob("*") if p.is_file() and p.name != ".lock"} == before
    code, _, err = cli("run", won, "--runs-dir", runs)  # its own file, again: never refused
    assert code == 0, err
    code, _, err = cli("run", lost, "--runs-dir", runs, "--replace")  # told to: the folder becomes the other's
    assert code == 0, err
    assert read_json(mdir / "source.json")["file"] == str(lost) and len(list(mdir.glob("*/cell.json"))) == 2
    assert (mdir / "matrix.yaml").read_text() == lost.read_text()
    (now,) = read_json(mdir / "cells.json")
    board = json.loads((mdir / "leaderboard.json").read_text())
    assert now["id"] != only["id"] and [r["cell"] for r in board["rows"]] == [now["slug"]]
