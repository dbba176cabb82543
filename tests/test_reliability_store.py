"""The store under SIGKILL: a reader never sees half a file, a torn JSON-lines record is dropped and cut off,
and a cell folder's lock is freed by the kernel when its holder dies, however it dies, and lasts as long as
any process it was handed to lives."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

from processes import pid_alive, wait_for

from tunelab.core.files import append_jsonl, read_json, read_jsonl, write_json
from tunelab.core.locks import CellLock, Locked, is_locked, lock, lock_holder

WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from tunelab.core.files import append_jsonl, write_json
    path, kind = Path(sys.argv[1]), sys.argv[2]
    n = 0
    while True:
        n += 1
        body = {"n": n, "pad": str(n % 10) * 200_000}  # 200 kB: a write takes a while, and is killed in it
        if kind == "json":
            write_json(path, body)
        else:
            append_jsonl(path, body)
""")


def writer(path, kind: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(path), kind], env={**os.environ})


def test_a_file_written_atomically_is_never_half_written_even_under_sigkill(tmp_path):
    path, rng = tmp_path / "results.json", random.Random(0)
    for _ in range(8):
        proc = writer(path, "json")
        wait_for(path.is_file, "a first write", proc)
        end = time.monotonic() + rng.uniform(0.05, 0.4)
        while time.monotonic() < end:  # read while it writes
            body = read_json(path)
            assert body is not None and body["pad"] == str(body["n"] % 10) * 200_000
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        body = json.loads(path.read_text())  # and after the kill: whole, never cut
        assert body["pad"] == str(body["n"] % 10) * 200_000


def test_json_lines_killed_mid_append_keep_their_complete_records(tmp_path):
    path, rng = tmp_path / "metrics.jsonl", random.Random(1)
    for _ in range(5):  # several writers in turn, each killed at a random moment, appending to one file
        proc = writer(path, "jsonl")
        wait_for(path.is_file, "a first record", proc)
        time.sleep(rng.uniform(0.05, 0.3))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        records = read_jsonl(path)
        assert records and all(r["pad"] == str(r["n"] % 10) * 200_000 for r in records)


def test_a_torn_record_is_dropped_on_read_and_cut_off_before_the_next_append(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append_jsonl(path, {"step": 1})
    with path.open("a") as f:
        f.write('{"step": 2, "loss": 0.')  # a crash in the middle of a record
    assert read_jsonl(path) == [{"step": 1}]
    append_jsonl(path, {"step": 2})
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    # Damage in the middle is not a crash's: the line is left out and said, naming the file and the line.
    path.write_bytes(b'{"step": 1}\nnot json\n\xff\xfe\n[3]\n{"step": 5}\n')
    said: list[str] = []
    assert read_jsonl(path, on_damage=said.append) == [{"step": 1}, {"step": 5}]
    assert [w.split(": ", 1)[1] for w in said] == [
        "line 2 is not JSON (Expecting value): left out (damaged since it was written)",
        "line 3 is not UTF-8 (byte 0): left out (damaged since it was written)",
        "line 4 is not a JSON object: left out (damaged since it was written)"]
    assert all(w.startswith(str(path)) for w in said)
    try:  # a user's data file (not one tunelab appends to): a line that is not JSON is a mistake, named
        read_jsonl(path, appended=False)
    except ValueError as e:
        assert "line 2 is not JSON" in str(e) and str(path) in str(e)
    else:
        raise AssertionError("a damaged line of a data file was read silently")


HOLDER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from tunelab.core.locks import CellLock
    held = CellLock(Path(sys.argv[1]))
    assert held.acquire()
    print("held", flush=True)
    time.sleep(600)
""")


def test_the_kernel_frees_the_lock_of_a_killed_holder(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    assert is_locked(tmp_path) and f"pid {proc.pid}" in lock_holder(tmp_path)
    assert not CellLock(tmp_path).acquire(wait=0.3)  # a bounded wait gives up
    try:
        with lock(tmp_path):
            raise AssertionError("took a held lock")
    except Locked:
        pass
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not is_locked(tmp_path)
    with lock(tmp_path):
        assert is_locked(tmp_path)  # from another open file description, even in this process


def test_a_lock_handed_to_a_child_outlives_its_parent(tmp_path):
    """What the runner does: it takes the lock, hands the descriptor to the cell process, and dies (kill -9);
    the cell keeps the folder until it ends."""
    parent = textwrap.dedent("""
        import subprocess, sys
        from pathlib import Path
        from tunelab.core.locks import CellLock
        held = CellLock(Path(sys.argv[1]))
        assert held.acquire()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], pass_fds=(held.fileno(),))
        held.note(f"cell process pid {child.pid}")
        print(child.pid, flush=True)
        held.release()  # the parent lets go of its copy: the child's keeps the lock
        import time; time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert pid_alive(child) and is_locked(tmp_path)
        assert f"cell process pid {child}" in lock_holder(tmp_path)
    finally:
        os.kill(child, signal.SIGKILL)
    wait_for(lambda: not pid_alive(child) or _reap(child), "the child to die")
    assert not is_locked(tmp_path)


def _reap(pid: int) -> bool:
    try:  # the child's parent is dead: init reaps it; a zombie no longer holds descriptors anyway
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


def test_asking_never_erases_what_the_holder_wrote(tmp_path):
    held = CellLock(tmp_path)
    assert held.acquire()
    before = lock_holder(tmp_path)
    for _ in range(3):
        assert is_locked(tmp_path)
    assert lock_holder(tmp_path) == before and f"pid {os.getpid()}" in before
    held.release()
    write_json(tmp_path / "x.json", {"a": 1})
    assert not is_locked(tmp_path)
