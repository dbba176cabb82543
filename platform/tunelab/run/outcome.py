"""How a cell's attempt ended, in words a user can act on: an `Outcome` per cell, and an exit status's cause."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

from tunelab.matrix.expansion import Cell


@dataclass
class Outcome:
    cell: Cell
    # done | done-elsewhere (another runner finished it) | failed | interrupted (this runner was stopped; it will
    # resume) | killed (killed from outside, alone: the OOM killer, a user; it will resume) |
    # paused (it reached its stop_at: a search's rung) | skipped-done | skipped-reached (it had reached its stop_at) |
    # skipped-failed | skipped-locked | skipped-queued (SLURM holds its job) | submitted | written
    state: str
    error: str | None = None


# Signals that end a process from outside (the OOM killer, a user, the batch system): the cell did nothing wrong
# and resumes from its last checkpoint, `interrupted`. A crash (SIGSEGV, SIGABRT ...) is a failure.
KILLS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _signal_of(rc: int, log_tail: list[str] | tuple[str, ...] = ()) -> int | None:
    if rc > 0:
        worker = [int(m.group(1)) for line in log_tail if (m := re.search(r"exitcode\s*:\s*(-\d+)", line))]
        if worker:
            return -worker[-1]
    return -rc if rc < 0 else rc - 128 if rc > 128 else None  # 128+N: a shell's way of saying signal N


def killed_from_outside(rc: int, log_tail: list[str] | tuple[str, ...] = ()) -> bool:
    """Whether an exit status is a kill from outside (KILLS), the cell's own or, under torchrun, a worker's."""
    return _signal_of(rc, log_tail) in KILLS


def exit_cause(rc: int, log_tail: list[str] | tuple[str, ...] = ()) -> str:
    """An exit status in words: a signal by its name and what usually sends it. torchrun exits 1 when a
    worker dies; the worker's own exit code is then taken from torchrun's report in the log."""
    if rc > 0:
        worker = [int(m.group(1)) for line in log_tail if (m := re.search(r"exitcode\s*:\s*(-\d+)", line))]
        if worker:
            return f"{exit_cause(worker[-1])} (a worker process; torchrun exited with code {rc})"
    sig = -rc if rc < 0 else rc - 128 if rc > 128 else None  # 128+N: a shell's way of saying signal N
    try:
        name = signal.Signals(sig).name if sig else None
    except ValueError:
        name = None
    if name is None:
        return f"exited with code {rc}"
    why = {"SIGKILL": "the kernel's out-of-memory killer (see `dmesg`), the batch system or a user",
           "SIGTERM": "the batch system (time limit, preemption), a shutdown or a user",
           "SIGINT": "Ctrl-C", "SIGSEGV": "a crash in native code (a library, a kernel driver)",
           "SIGBUS": "a crash in native code, or a memory-mapped file that went away",
           "SIGABRT": "a crash: native code aborted", "SIGILL": "a crash: an instruction this CPU lacks",
           "SIGFPE": "a crash in native code"}.get(name)
    return f"killed by {name}" + (f": usually {why}" if why else "")
