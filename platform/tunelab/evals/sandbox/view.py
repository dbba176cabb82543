"""What of the host a sandboxed program sees: the Python installation, read-only, and nothing else.

The sandbox's root is an empty tmpfs. Into it go, at their host paths and read-only:
the interpreter binary, its standard library (with lib-dynload), the shared libraries
the interpreter and its extension modules load, the dynamic loader, `/etc/ld.so.cache`,
and the symlinks on the way to each of these, so the loader resolves names exactly as
on the host. No `/etc` beyond the cache, no `/home`, `/root`, `/tmp`, `/proc`, `/sys`,
no other binaries (no shell), and no site-packages or dist-packages of any interpreter:
a folder of that name inside the standard library (pyenv and other source builds put
site-packages there) is left out, as are the standard library's own tests, idlelib,
tkinter, turtledemo and the static-library folder (config-*), which no program needs.

Which shared libraries are needed is measured, not guessed: a probe interpreter imports
every extension module of lib-dynload and lists the files mapped into its memory
(/proc/self/maps). The probe runs once per interpreter and process.

The programs read these files from a **private copy on a tmpfs** (/dev/shm, or
$TUNELAB_SANDBOX_VIEW_DIR), made once per user and installation, not from the host's
disk. A disk file's pages come and go in the page cache that every process shares, and a
program can tell a cached page from an uncached one by timing a read: files every sandbox
reads would be a memory that outlives each run. A tmpfs file is always in memory, its
folders keep no entries for missing names, and its read-only mounts keep no access
times: nothing a program does to it can be seen by the next one. Where no tmpfs that
allows executing files is writable (a container's /dev/shm mounted noexec, say), the
host's files are bound instead and `PythonView.kind` says so. A copy no process holds any more
(each holds a shared lock on its own) is removed when a process finds a newer one.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

# Runs outside the sandbox, as the evaluator; trusted code only (the stdlib's own modules).
_PROBE = r"""
import importlib, json, os, sys, sysconfig
# Left out: Tk, curses and readline (no display, no terminal in the sandbox), nis (a network
# client, gone in 3.13), test modules.
SKIPPED = ("_tkinter", "_curses", "readline", "nis", "_test", "xx", "_xx", "_ctypes_test")
paths = {p for p in (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]) if p}
paths |= {p for p in sys.path if p and os.path.isdir(p)}
for d in [p for p in sys.path if p.endswith("lib-dynload") and os.path.isdir(p)]:
    for name in sorted(os.listdir(d)):
        if name.endswith(".so") and not name.startswith(SKIPPED):
            try:
                importlib.import_module(name.split(".")[0])
            except BaseException:
                pass
with open("/proc/self/maps") as f:
    mapped = sorted({line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6})
print(json.dumps({"dirs": sorted(paths), "mapped": [m for m in mapped if m.startswith("/")]}))
"""

_TOP_LEVEL_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Folders of the standard library that are not the standard library a program may use.
_LEFT_OUT = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "tkinter", "turtledemo"})
_TMPFS = ("tmpfs", "shm")  # /proc/self/mounts names a tmpfs so, or shm on some kernels
KIND_COPY, KIND_HOST = "tmpfs copy", "host files"


@dataclass(frozen=True)
class PythonView:
    executable: str  # the interpreter's real path, as run inside the sandbox
    bwrap_args: tuple[str, ...]  # --ro-bind / --symlink arguments that build the view
    kind: str = KIND_HOST  # KIND_COPY: the files come from a private tmpfs copy; KIND_HOST: the host's
    source: str | None = None  # the copy's folder


@functools.cache
def python_view(executable: str) -> PythonView:
    """The view for the interpreter `executable` (a venv's python resolves to its base)."""
    exe = os.path.realpath(executable)
    probe = subprocess.run(
        [exe, "-S", "-s", "-c", _PROBE], env={"LANG": "C.UTF-8"}, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if probe.returncode != 0:
        raise RuntimeError(f"could not list the files of {exe}: {probe.stderr.strip()[-500:]}")
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    dirs = [d for d in found["dirs"] if os.path.isdir(d) and not _left_out(d)]
    files = [exe, *(m for m in found["mapped"] if os.path.isfile(m) and not _under(m, dirs))]
    interpreter = _elf_interpreter(exe)
    if interpreter:
        files.append(interpreter)
    if os.path.isfile("/etc/ld.so.cache"):
        files.append("/etc/ld.so.cache")
    view = _View()
    for name in _TOP_LEVEL_LINKS:  # merged-/usr systems: library paths in the cache go through them
        if os.path.islink("/" + name):
            view.symlink(os.readlink("/" + name), "/" + name)
    for path in [*dirs, *files]:
        view.expose(path)
    for lib in files:
        for alias in _soname_aliases(lib):
            view.expose(alias)
    copy = _private_copy(view, exe)
    if copy is None:
        return PythonView(exe, tuple(view.host_args()), KIND_HOST, None)
    return PythonView(exe, tuple(view.copy_args(copy)), KIND_COPY, copy)


class _View:
    """The real paths to show, and the symlinks met on the way to each."""

    def __init__(self) -> None:
        self.links: dict[str, str] = {}  # path -> target
        self.bound: list[str] = []  # real paths (folders and files), none below another

    def symlink(self, target: str, path: str) -> None:
        self.links.setdefault(path, target)

    def expose(self, path: str) -> None:
        real = self._walk(path)
        if not _under(real, self.bound):
            self.bound = [b for b in self.bound if not _under(b, [real])] + [real]

    def entries(self) -> Iterator[str]:
        """Every file, folder and symlink to show, as paths; folders left out are not entered."""
        for root in sorted(self.bound):
            yield root
            if not os.path.isdir(root):
                continue
            for folder, subdirs, names in os.walk(root):
                subdirs[:] = sorted(d for d in subdirs if not _left_out(d))
                for name in sorted(subdirs + names):
                    if not name.endswith((".opt-1.pyc", ".opt-2.pyc")):
                        yield os.path.join(folder, name)

    def left_out(self) -> list[str]:
        found = []
        for root in sorted(self.bound):
            for folder, subdirs, _ in os.walk(root) if os.path.isdir(root) else ():
                found += [os.path.join(folder, d) for d in subdirs if _left_out(d)]
                subdirs[:] = [d for d in subdirs if not _left_out(d)]
        return found

    def host_args(self) -> list[str]:
        """Bind the host's files; cover what is left out with an empty, read-only tmpfs."""
        made: set[str] = set()
        args = self._link_args(made, top_level_only=False)
        for real in sorted(self.bound):
            args += _parents(real, made, self.bound) + ["--ro-bind", real, real]
        for folder in self.left_out():
            args += ["--tmpfs", folder, "--remount-ro", folder]
        return args

    def copy_args(self, copy: str) -> list[str]:
        """The copy holds everything below the root; only the root's own symlinks are made here."""
        args = self._link_args(set(), top_level_only=True)
        for top in sorted(os.listdir(copy)):
            if os.path.isdir(os.path.join(copy, top)) and not os.path.islink(os.path.join(copy, top)):
                args += ["--ro-bind", os.path.join(copy, top), "/" + top]
        return args

    def _link_args(self, made: set[str], top_level_only: bool) -> list[str]:
        args: list[str] = []
        for path, target in sorted(self.links.items()):
            if os.path.dirname(path) == "/" or not (top_level_only or _under(path, self.bound)):
                args += _parents(path, made, self.bound) + ["--symlink", target, path]
        return args

    def _walk(self, path: str) -> str:
        """Resolve `path` as the kernel would, recording every symlink met on the way."""
        pending, current = [p for p in path.split("/") if p], "/"
        for _ in range(256):  # bounds a symlink loop
            if not pending:
                return current
            part = pending.pop(0)
            if part == ".":
                continue
            if part == "..":
                current = os.path.dirname(current)
                continue
            candidate = os.path.join(current, part)
            if os.path.islink(candidate):
                target = os.readlink(candidate)
                self.symlink(target, candidate)
                pending = [p for p in target.split("/") if p] + pending
                current = "/" if target.startswith("/") else current
            else:
                current = candidate
        raise RuntimeError(f"too many symlinks resolving {path}")


def _private_copy(view: _View, exe: str) -> str | None:
    """The folder of a complete copy of the view on a tmpfs, made now if need be; None where
    there is no usable tmpfs or the copy failed (then the host's files are bound). The copy is
    named after the files it holds, so a change on the host (a new ld.so.cache) makes another."""
    base = os.environ.get("TUNELAB_SANDBOX_VIEW_DIR", "/dev/shm")
    if not _usable_tmpfs(base):
        return None
    entries = list(view.entries())
    digest = hashlib.sha256(exe.encode())
    for path in entries:
        st = os.lstat(path)
        digest.update(f"{path}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    for path, target in sorted(view.links.items()):
        digest.update(f"{path}\0{target}\n".encode())
    final = os.path.join(base, f"tunelab-view-{os.geteuid()}-{digest.hexdigest()[:20]}")
    if not _hold(final):
        _sweep(base, unfinished=True)
        try:
            work = tempfile.mkdtemp(prefix=".tunelab-view-", dir=base)
        except OSError:
            return None
        try:
            _fill(work, view, entries)
            os.rename(work, final)
        except OSError:  # no space, or another process renamed its copy in first
            shutil.rmtree(work, ignore_errors=True)
        if not _hold(final):
            return None
    _sweep(base, unfinished=False)
    return final


_HELD: list[int] = []  # a shared lock on each copy this process uses, for as long as it lives


def _hold(folder: str) -> bool:
    """Take a shared lock on a complete copy, so that no other process removes it while this one
    (and the sandboxes it starts, which die with it) may still use it."""
    try:
        fd = os.open(os.path.join(folder, ".complete"), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    fcntl.flock(fd, fcntl.LOCK_SH)
    if _complete(folder) and os.fstat(fd).st_ino == os.lstat(os.path.join(folder, ".complete")).st_ino:
        _HELD.append(fd)
        return True
    os.close(fd)  # removed meanwhile
    return False


def _sweep(base: str, unfinished: bool) -> None:
    """Remove copies of ours that no process holds (made for files the host has since changed),
    or, with `unfinished`, copies a killed process left half made (an hour old: none is being made)."""
    for name in os.listdir(base):
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != os.geteuid() or not os.path.isdir(path) or os.path.islink(path):
            continue
        if unfinished and name.startswith(".tunelab-view-") and time.time() - st.st_mtime > 3600:
            shutil.rmtree(path, ignore_errors=True)
        elif not unfinished and name.startswith(f"tunelab-view-{os.geteuid()}-") and _unused(path):
            gone = tempfile.mkdtemp(prefix=".tunelab-view-", dir=base)
            os.rename(path, os.path.join(gone, name))  # out of every name at once, then removed
            shutil.rmtree(gone, ignore_errors=True)


def _unused(folder: str) -> bool:
    try:
        fd = os.open(os.path.join(folder, ".complete"), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False  # not finished, or not a copy: not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True  # the lock goes with the folder
    except OSError:
        return False
    finally:
        os.close(fd)


def _fill(work: str, view: _View, entries: list[str]) -> None:
    for path in entries:
        target = work + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.islink(path):
            os.symlink(os.readlink(path), target)
        elif os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
        elif os.path.isfile(path):
            shutil.copy2(path, target)  # with its mtime, which keeps the stdlib's .pyc files valid
            os.chmod(target, (os.stat(path).st_mode & 0o755) | 0o444)
    for path, link_target in view.links.items():
        if os.path.dirname(path) != "/" and not os.path.lexists(work + path):
            os.makedirs(os.path.dirname(work + path), exist_ok=True)
            os.symlink(link_target, work + path)
    for folder, _, _ in os.walk(work):
        os.chmod(folder, 0o755)  # world-searchable: the throwaway uid of a root evaluator reads it
    with open(os.path.join(work, ".complete"), "w"):
        pass


def _complete(folder: str) -> bool:
    """Ours (no other user could have planted it), closed to others' writes, and finished."""
    try:
        st, marker = os.lstat(folder), os.lstat(os.path.join(folder, ".complete"))
    except OSError:
        return False
    mine = st.st_uid == marker.st_uid == os.geteuid()
    return mine and os.path.isdir(folder) and not os.path.islink(folder) and not st.st_mode & 0o022


def _usable_tmpfs(base: str) -> bool:
    """A tmpfs we may write, on which files may be executed (the interpreter, its libraries)."""
    if not (os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK)):
        return False
    if os.statvfs(base).f_flag & os.ST_NOEXEC:
        return False
    real, best, fstype = os.path.realpath(base), "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                point, kind = line.split()[1], line.split()[2]
                if _under(real, [point]) and len(point) >= len(best):
                    best, fstype = point, kind
    except OSError:
        return False
    return fstype in _TMPFS


def _parents(path: str, made: set[str], bound: list[str]) -> list[str]:
    """Create the folders above `path` world-searchable: bwrap would make them 0700, closing
    them to the throwaway uid of a root evaluator."""
    args, missing, parent = [], [], os.path.dirname(path)
    while parent != "/" and parent not in made and not _under(parent, bound):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for d in reversed(missing):
        made.add(d)
        args += ["--perms", "0755", "--dir", d]
    return args


def _left_out(path: str) -> bool:
    name = os.path.basename(path.rstrip("/"))
    return name in _LEFT_OUT or name.startswith("config-")


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _soname_aliases(lib: str) -> list[str]:
    """libffi.so.8.1.2 is loaded by the name libffi.so.8: the shorter versioned names in its
    folder that lead to the same file (the loader asks for the soname, never for libffi.so)."""
    folder, name = os.path.split(lib)
    aliases, parts = [], name.split(".")
    real = os.path.realpath(lib)
    while len(parts) > 3 and parts[-1].isdigit() and parts[-2].isdigit():  # libz.so.1.2.13 -> libz.so.1, not libz.so
        parts.pop()
        alias = os.path.join(folder, ".".join(parts))
        if alias != lib and os.path.islink(alias) and os.path.realpath(alias) == real:
            aliases.append(alias)
    return aliases


def _elf_interpreter(path: str) -> str | None:
    """PT_INTERP of a 64-bit little-endian ELF executable (the dynamic loader's path)."""
    with open(path, "rb") as f:
        header = f.read(64)
        if header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
            return None
        (phoff,) = struct.unpack_from("<Q", header, 32)
        phentsize, phnum = struct.unpack_from("<HH", header, 54)
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            p_type, _, p_offset, _, _, p_filesz = struct.unpack("<IIQQQQ", f.read(40))
            if p_type == 3:  # PT_INTERP
                f.seek(p_offset)
                return f.read(p_filesz).rstrip(b"\0").decode()
    return None
