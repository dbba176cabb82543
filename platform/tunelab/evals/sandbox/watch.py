"""Memory of all a program's processes together where no memory cgroup can be made (issue 51).

RLIMIT_AS bounds each process's address space, not their sum (32 processes may each hold `memory_mb`), nor the
page tables that map it (a page in a 2 MiB span of its own needs a 4 KiB page table: twice `memory_mb` per
process). Where the kernel gives the evaluator no cgroup (an unprivileged evaluator on cgroup v1, a container
without a writable cgroup), a thread of the evaluator's watches instead: every POLL_S it walks the sandbox's
process tree from its init (every process of the pid namespace descends from it: an orphan is reparented to
it) and sums what each holds that is the program's, from /proc/<pid>/status:

    RssAnon   its private memory (heap, stacks, copied-on-write pages)
    RssShmem  shared anonymous memory and mapped tmpfs files (/work is bounded by its own size, but a
              MAP_SHARED|MAP_ANONYMOUS region is counted nowhere else); the interpreter's own files, a tmpfs
              copy (view.py), count here too: a few MiB a process
    VmPTE     its page tables
    VmSize    its mappings' kernel records: each mapping spans a page at least, so at most VmSize / 4 KiB of them,
              each charged VMA_BYTES (a process of 256 MB of one-page mappings holds 65,536 of them: 16 MiB)
    its descriptors: the most the kernel can hold for them, charged whatever they hold now (their buffers are
              in no /proc count): a socket's queue holds at most one peer's send buffer (sockets come only in
              socketpairs, their buffers at the default: docs/RELIABILITY.md), 2 x net.core.wmem_default + 8 KiB;
              a pipe at most 16 pages (F_SETPIPE_SZ is refused)

Past `memory_mb` the watch kills the sandbox's init, which takes every process of the namespace with it, and the
result says why. A sum per process is conservative: a page shared after fork counts once in each process that
maps it, so a many-process program is held to less than `memory_mb` in truth (a cgroup counts each page once).
Not a kernel limit: between two looks a program can allocate what its processes fault in in POLL_S (each still
within RLIMIT_AS); benchmarks and tests/test_sandbox.py measure the overshoot. docs/RELIABILITY.md says what it
covers and what it does not."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

POLL_S = 0.01
_FIELDS = (b"RssAnon:", b"RssShmem:", b"VmPTE:")
VMA_BYTES = 256  # a vm_area_struct (about 200 bytes on x86_64) and its anon_vma links, rounded up
PIPE_BYTES = 16 * 4096


def _socket_bytes() -> int:
    try:
        with open("/proc/sys/net/core/wmem_default") as f:
            return 2 * int(f.read()) + 8192
    except (OSError, ValueError):
        return 2 * 212_992 + 8192  # the kernel's own default


SOCKET_BYTES = _socket_bytes()


def processes(init: int) -> list[int]:
    """`init` and every process below it (through every thread's children)."""
    out, todo = [], [init]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # gone
            continue
        for tid in tids:
            with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                todo.extend(int(c) for c in f.read().split())
    return out


def held(pid: int) -> int:
    """Bytes of `pid` that are the program's (module docstring); 0 for a process gone, or a zombie."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except OSError:
        return 0
    kb = 0
    for line in status.splitlines():
        if line.startswith(_FIELDS):
            kb += int(line.split()[1])
        elif line.startswith(b"VmSize:"):
            kb += int(line.split()[1]) // 4 * VMA_BYTES // 1024
    return (kb << 10) + buffers(pid)


def buffers(pid: int) -> int:
    """The most the kernel can hold for `pid`'s sockets and pipes (module docstring). A descriptor shared after
    fork is charged in each process that holds it."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0
    total = 0
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        total += SOCKET_BYTES if target.startswith("socket:") else PIPE_BYTES if target.startswith("pipe:") else 0
    return total


class Watch:
    """Watches the processes under a sandbox's init (`pid`, and a pidfd of it to kill by: never a reused pid) until
    `stop()`; kills them all once they hold more than `limit` bytes together."""

    def __init__(self, pid: int, pidfd: int, limit: int) -> None:
        self.pid, self.pidfd, self.limit = pid, pidfd, limit
        self.peak = 0  # bytes: the most seen at once
        self.exceeded = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"sandbox-memory-{pid}", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while True:
            total = sum(held(p) for p in processes(self.pid))
            self.peak = max(self.peak, total)
            if total > self.limit:
                self.exceeded = True
                with contextlib.suppress(OSError):  # (the pidfd stays open until stop() has joined this thread)
                    signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
                return
            if self._stop.wait(POLL_S):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
