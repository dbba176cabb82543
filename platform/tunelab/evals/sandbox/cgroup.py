"""A memory cgroup per sandboxed program, where the machine lets the evaluator make one.

RLIMIT_AS bounds each process's address space; it neither adds the processes of a program
up nor sees the memory the kernel holds for them (tmpfs pages, pipe buffers, page tables,
inodes and dentries). A memory cgroup does: all of it is charged to one limit, and past it
the kernel's OOM killer ends the program. Where one can be made, `contain.py` puts the
sandbox's init in it before the program starts (bwrap waits on --block-fd meanwhile), so
that every process of the program is in it from its first instruction.

Used, in this order:

- cgroup v2: a child of $TUNELAB_SANDBOX_CGROUP, or else of the parent of our own cgroup,
  if that folder has the memory controller in its cgroup.subtree_control and we may write
  it (a delegated subtree: systemd's `Delegate=yes`, a container that owns its cgroup);
- cgroup v1's memory controller (a child of our own memory cgroup), whose folders a root
  evaluator may usually make, as in the containers this project's CI runs in.

Elsewhere `Cgroup.create` returns None and `contain.py` relies on its other bounds and a watch
over all the program's processes together (`watch.py`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass

_PREFIX = "tunelab-sandbox-"


@dataclass(frozen=True)
class _Parent:
    path: str
    version: int  # 1 or 2


@dataclass
class Cgroup:
    path: str
    version: int

    @classmethod
    def create(cls, limit_bytes: int) -> Cgroup | None:
        """A new memory cgroup limited to `limit_bytes` (swap included); None where the machine
        has none to offer (`describe()` is None then); OSError where making one failed."""
        parent = _parent()
        if parent is None:
            return None
        group = cls(os.path.join(parent.path, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"), parent.version)
        os.mkdir(group.path)
        try:
            if parent.version == 2:
                group._write("memory.max", limit_bytes)
                group._write("memory.swap.max", 0, optional=True)
                group._write("memory.oom.group", 1, optional=True)  # an OOM kill ends the whole program
            else:
                group._write("memory.limit_in_bytes", limit_bytes)
                group._write("memory.memsw.limit_in_bytes", limit_bytes, optional=True)
        except OSError:
            group.remove()
            raise
        return group

    def add(self, pid: int) -> None:
        self._write("cgroup.procs", pid)

    def peak(self) -> int | None:
        """The most memory the program held at once, in bytes (None where the kernel does not say)."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(self.path, name)) as f:
                return int(f.read().split()[0])
        return None

    def oom_killed(self) -> bool:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(self.path, name)) as f:
                fields = dict(line.split() for line in f if len(line.split()) == 2)
            return int(fields.get("oom_kill", "0")) > 0
        return False

    def remove(self) -> None:
        """Remove the folder once its last process has gone (the kernel may lag the exit a moment)."""
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)
        # Still busy: left for _sweep, which removes it the next time a process starts.

    def _write(self, name: str, value: int, optional: bool = False) -> None:
        target = os.path.join(self.path, name)
        if optional and not os.path.exists(target):
            return
        with open(target, "w") as f:
            f.write(str(value))


def describe() -> str | None:
    parent = _parent()
    return None if parent is None else f"v{parent.version} memory"


@functools.cache
def _parent() -> _Parent | None:
    """The first candidate under which a limited child can really be made (tried once)."""
    for parent in _candidates():
        if not os.access(os.path.join(parent.path, "cgroup.procs"), os.W_OK):
            continue
        _sweep(parent.path)
        trial = Cgroup(os.path.join(parent.path, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"), parent.version)
        try:
            os.mkdir(trial.path)
            trial._write("memory.max" if parent.version == 2 else "memory.limit_in_bytes", 64 << 20)
        except OSError:
            continue
        finally:
            trial.remove()
        return parent
    return None


def _candidates() -> Iterator[_Parent]:
    mounts = _mounts()
    ours = _own_cgroups()
    v2 = mounts.get("cgroup2")
    if v2 is not None:
        folders = [os.environ["TUNELAB_SANDBOX_CGROUP"]] if os.environ.get("TUNELAB_SANDBOX_CGROUP") else []
        if "" in ours:  # our cgroup's parent; the root itself where ours is the root (no parent to see)
            own = _join(v2, ours[""])
            folders.append(own if own == os.path.normpath(v2[0]) else os.path.dirname(own))
        for folder in folders:
            if "memory" in _read(os.path.join(folder, "cgroup.subtree_control")).split():
                yield _Parent(folder, 2)
    v1 = mounts.get("memory")
    if v1 is not None and "memory" in ours:
        yield _Parent(_join(v1, ours["memory"]), 1)


def _mounts() -> dict[str, tuple[str, str]]:
    """cgroup2 and v1 memory mounts: {"cgroup2" | "memory": (mount point, root of the mount)}."""
    found: dict[str, tuple[str, str]] = {}
    for line in _read("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        fields, fs = left.split(), right.split()
        if len(fields) < 5 or len(fs) < 3:
            continue
        if fs[0] == "cgroup2":
            found.setdefault("cgroup2", (fields[4], fields[3]))
        elif fs[0] == "cgroup" and "memory" in fs[2].split(","):
            found.setdefault("memory", (fields[4], fields[3]))
    return found


def _own_cgroups() -> dict[str, str]:
    """Our cgroup per v1 controller, and under "" the v2 one."""
    found = {}
    for line in _read("/proc/self/cgroup").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                found[controller] = parts[2]
    return found


def _join(mount: tuple[str, str], cgroup: str) -> str:
    point, root = mount
    relative = os.path.relpath(cgroup, root) if cgroup.startswith(root) else cgroup.lstrip("/")
    return os.path.normpath(os.path.join(point, relative))


def _sweep(parent: str) -> None:
    """Remove folders left by evaluators that died between making and removing them."""
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            pid = name[len(_PREFIX) :].split("-")[0]
            if name.startswith(_PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(parent, name))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""
