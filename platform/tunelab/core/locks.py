"""Per-folder locks: a cell folder is worked in only under its flock, which the kernel releases when the holder
dies, so a lock is never stale and a status that still says "running" under a free lock belongs to a dead process
(`CellFolder.live_state`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from tunelab.core.files import PLACE_ERRORS, cannot_write

LOCKED_EXIT = 3  # a cell process's exit code when another process holds its folder's lock
# The launcher holds the cell folder's lock for the cell process it starts (and hands it the descriptor):
# the cell must not lock again. The value names the folder, so it cannot apply to any other one.
LOCK_HELD_ENV = "TUNELAB_LOCK_HELD"


class Locked(Exception):
    pass


class CellLock:
    """The exclusive flock on a cell folder's `.lock`, held while a process works in the folder.

    The kernel drops it when every holder of the descriptor has exited, however it died, so a lock is never
    stale. The holder writes who it is into the file (a waiting process names it); a process that only asks
    never truncates it. A launcher may hand the descriptor to its child (`fileno`, subprocess pass_fds): the
    lock then lasts as long as either lives, so a cell that outlives a killed runner keeps its folder."""

    POLL_S = 0.2

    def __init__(self, run_dir: Path, name: str = ".lock"):
        self.path = run_dir / name  # another name: a lock of its own in that folder (a checkpoint's evaluation)
        self._f: IO[str] | None = None

    def acquire(self, wait: float | None = 0.0) -> bool:
        """Take the lock: at once (wait=0), within `wait` seconds, or whenever it is free (wait=None)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            f = self.path.open("a+")
        except OSError as e:
            raise (cannot_write(self.path, e) if e.errno in PLACE_ERRORS else e) from None
        deadline = None if wait is None else time.monotonic() + wait
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | (0 if wait is None else fcntl.LOCK_NB))
                break
            except BlockingIOError:
                if deadline is not None and time.monotonic() >= deadline:
                    f.close()
                    return False
                time.sleep(self.POLL_S)
        try:
            f.truncate(0)
            f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S %z')}\n")
            f.flush()
        except OSError as e:  # a full disk, a quota: the lock cannot say who holds it, so it is not taken
            with contextlib.suppress(OSError):  # closing flushes what could not be written, and fails again
                f.close()
            raise (cannot_write(self.path, e) if e.errno in PLACE_ERRORS else e) from None
        self._f = f
        return True

    def acquire_saying(self, say: Callable[[str], None], waiting: str, every: float = 60.0) -> None:
        """Take the lock whenever it is free, never silently: at once, whenever the holder's state changes
        (running, stopped, gone) and every `every` seconds, `say` "`waiting` (who holds it, what it is doing)"."""
        said, said_at = None, 0.0
        while not self.acquire(wait=0 if said is None else 1.0):
            now = holder(self.path)
            if now != said or time.monotonic() - said_at >= every:
                say(f"{waiting} ({now})")
                said, said_at = now, time.monotonic()

    def holder(self) -> str:
        return holder(self.path)

    def note(self, text: str) -> None:
        """Add to what the holder says of itself (the launcher: the pid of the cell process it started)."""
        assert self._f is not None, "not held"
        self._f.seek(0, os.SEEK_END)
        self._f.write(f"{text}\n")
        self._f.flush()

    def fileno(self) -> int:
        assert self._f is not None, "not held"
        return self._f.fileno()

    def release(self) -> None:
        """Close the descriptor: the kernel frees the lock once no process holds it open. (Not LOCK_UN:
        that would free it under a child that inherited it and still works.)"""
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> CellLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@contextmanager
def lock(run_dir: Path, wait: float = 0.0) -> Iterator[None]:
    """Work in a cell folder under its lock; Locked if another process holds it for longer than `wait` s."""
    held = CellLock(run_dir)
    if not held.acquire(wait):
        raise Locked(str(run_dir))
    with held:
        yield


def is_locked(run_dir: Path) -> bool:
    """Whether a process holds the folder's lock. Asking takes it for an instant: a process starting at
    that moment must wait a little for it (tunelab.cell does), not give up."""
    if not (run_dir / ".lock").exists():
        return False
    probe = CellLock(run_dir)
    with open(probe.path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def lock_holder(run_dir: Path) -> str:
    """Who holds a folder's lock and what each of its processes is doing (`holder`), for messages."""
    return holder(run_dir / ".lock")


_PID = re.compile(r"\bpid (\d+)(?: on (\S+))?")


def process_state(pid: int) -> str:
    """What a process of this machine is doing, from /proc/PID/stat: running (or sleeping: it works), stopped (a
    SIGSTOP or Ctrl-Z: it holds what it holds until `kill -CONT`), or gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    code = stat[stat.rindex(")") + 2:][:1]
    return "stopped" if code in ("T", "t") else "gone" if code in ("Z", "X", "") else "running"


def holder(path: Path) -> str:
    """Who holds the lock file `path`, as its holder wrote it ("pid 123 on host since ...; cell process pid 456"),
    with what each process is doing: running, stopped (and how to go on) or gone (the kernel frees its lock when the
    last process holding it ends), or that it runs on another machine, where its state cannot be seen."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").split("\n") if line.strip()]
    except OSError:
        lines = []
    if not lines:
        return "another process (it has not said who it is yet)"
    here, host, out = socket.gethostname(), None, []
    for line in lines:
        m = _PID.search(line)
        if m is None:
            out.append(line)
            continue
        host = m.group(2) or host
        pid = int(m.group(1))
        if host is not None and host != here:
            state = "on another machine: its state cannot be seen from here"
        else:
            state = process_state(pid)
            if state == "stopped":
                state = f"stopped: `kill -CONT {pid}` lets it go on, `kill {pid}` ends it and frees the lock"
        out.append(f"{line} ({state})")
    return "; ".join(out)
