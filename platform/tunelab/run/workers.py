"""The runner's side of a together-group's process (cell/group.py): starting it with its members' folder locks,
the operations it is sent (train, release, end) and the events it answers with, each member's to its caller.

The runner holds each member folder's lock and hands the descriptor to the worker (pass_fds keeps its number;
core.locks.LOCK_FDS_ENV says which is whose), so a folder stays locked while either lives; a member released from
the worker is let go by both. A `Pool` keeps workers alive across a search's rungs (tune/driver.py): a promoted
trial goes on in the worker that holds it, without a process start or a checkpoint read.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tunelab.core import events
from tunelab.core.locks import LOCK_FDS_ENV, CellLock
from tunelab.folders.cell import CellFolder
from tunelab.folders.matrix import MatrixFolder
from tunelab.machine.threads import OWN_ENV
from tunelab.run.launch import STOP_AT_ENV, VALIDATE_AT_ENV, threads_env, worker_command

_COUNT = itertools.count()


class Stoppable(Protocol):
    """The runner's answer to Ctrl-C (run/runner.py Interrupts): it passes the signal on to this process."""

    proc: subprocess.Popen | None


@dataclass
class Worker:
    name: str
    proc: subprocess.Popen
    members: dict[Path, int]  # member folder -> its number in the worker
    held: dict[Path, CellLock]  # the runner's copies of the members' locks
    log: Path
    released: set[Path] = field(default_factory=set)
    rc: int | None = None  # its exit code, once it ended

    def alive(self) -> bool:
        return self.rc is None and self.proc.poll() is None

    def holds(self, folder: Path) -> bool:
        return self.alive() and folder in self.members and folder not in self.released

    def _send(self, op: dict) -> bool:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(op) + "\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):  # it died: its exit says how
            return False

    def _answer(self, on_event: Callable[[int, events.Event], None]) -> bool:
        """Events until Ready (True), or until the process ends (False; `rc` then says how)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            event, member = events.decode_tagged(line)
            if isinstance(event, events.Ready):
                return True
            if event is not None and member is not None:
                on_event(member, event)
        self.rc = self.proc.wait()
        return False

    def train(self, asks: dict[Path, tuple[int | None, tuple[int, ...]]],
              on_event: Callable[[Path, events.Event], None]) -> bool:
        """Train these members (each up to its stop_at, or to the end); False when the process ended instead."""
        by_k = {k: p for p, k in self.members.items()}
        op = {"op": "train", "members": {str(self.members[p]): {"stop_at": s, "validate_at": list(v)}
                                         for p, (s, v) in asks.items()}}
        return self._send(op) and self._answer(lambda k, ev: on_event(by_k[k], ev))

    def forget(self, folders: list[Path]) -> None:
        """Members the worker no longer holds (done or failed: it let go of their locks): the runner lets go too."""
        for p in folders:
            if p in self.held:
                self.released.add(p)
                self.held.pop(p).release()

    def release(self, folders: list[Path]) -> None:
        """The worker forgets these members and lets go of their locks; so does the runner."""
        mine = [p for p in folders if p in self.members and p not in self.released]
        if not mine:
            return
        if self.alive() and self._send({"op": "release", "members": [self.members[p] for p in mine]}):
            self._answer(lambda k, ev: None)
        for p in mine:
            self.released.add(p)
            self.held.pop(p).release()

    def end(self) -> int:
        if self.alive() and self._send({"op": "end"}):
            self._answer(lambda k, ev: None)
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        self.rc = self.proc.wait()
        for lock in self.held.values():
            lock.release()
        self.held.clear()
        return self.rc

    def log_tail(self, lines: int = 20) -> list[str]:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return []
        return [line[:400] for line in text.splitlines() if line.strip()][-lines:]


def start(key: str, members: list[tuple[CellFolder, CellLock]], matrix: MatrixFolder,
          stop: Callable[[subprocess.Popen], None] | None = None, mode: str = "exact") -> Worker:
    """Start a worker over these members (folder, the runner's lock of it), in this order. Each member's cell.log
    gets a line of its own: the attempt's first line, as a cell process's."""
    name = f"{key}-{os.getpid()}-{next(_COUNT)}"
    log = matrix.together_log(name)
    log.parent.mkdir(parents=True, exist_ok=True)
    dirs = [f.path.resolve() for f, _ in members]
    command = worker_command(name, dirs, mode)
    fds = {str(d): held.fileno() for d, (_, held) in zip(dirs, members)}
    env = {k: v for k, v in os.environ.items() if k not in (STOP_AT_ENV, VALIDATE_AT_ENV, *OWN_ENV)}
    # Its threads sized as a cell process's (run/launch.py): this machine's CPUs, the first member's count kept
    env.update({"PYTHONUNBUFFERED": "1", LOCK_FDS_ENV: json.dumps(fds), **threads_env(None, 1, members[0][0])})
    when = f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} runner pid {os.getpid()} on {socket.gethostname()}"
    with log.open("a") as out:
        out.write(f"{when} starts: {' '.join(command)}\n")
        out.flush()
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out, text=True,
                                env=env, pass_fds=tuple(fds.values()))
    for k, (folder, held) in enumerate(members):
        held.note(f"together-group process pid {proc.pid} (member {k} of {len(members)}, log {log})")
        with folder.log_file.open("a") as own:
            own.write(f"{when} starts: member {k} of {len(members)} of together-group process pid {proc.pid} "
                      f"(its log: {log})\n")
    if stop is not None:
        stop(proc)
    return Worker(name, proc, {d: k for k, d in enumerate(dirs)}, {d: held for d, (_, held) in zip(dirs, members)},
                  log)


@dataclass
class Pool:
    """Workers kept alive from one runner call to the next (a search's rungs)."""

    workers: list[Worker] = field(default_factory=list)

    def holding(self, folder: Path) -> Worker | None:
        self.reap()
        return next((w for w in self.workers if w.holds(folder.resolve())), None)

    def reap(self) -> None:
        """Workers that died or hold no member any more are gone, and the runner's copies of their locks with them."""
        for w in list(self.workers):
            if not w.alive() or not set(w.members) - w.released:
                w.end()
                self.workers.remove(w)

    def add(self, worker: Worker) -> None:
        self.workers.append(worker)

    def release(self, folders: list[Path]) -> None:
        resolved = [f.resolve() for f in folders]
        for w in self.workers:
            w.release(resolved)

    def end(self) -> None:
        for w in self.workers:
            w.end()
        self.workers.clear()
