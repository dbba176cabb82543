"""What of the host a sandboxed program sees: the Python installation, read-only, and nothing else.

The sandbox's root is an empty tmpfs. Into it go, at their host paths and read-only:
the interpreter binary, its standard library (with lib-dynload), the shared libraries
the interpreter and its extension modules load, the dynamic loader, `/etc/ld.so.cache`,
and the symlinks on the way to each of these, so the loader resolves names exactly as
on the host. No `/etc` beyond the cache, no `/home`, `/root`, `/tmp`, `/proc`, `/sys`,
no other binaries (no shell), no site-packages on `sys.path`.

Which shared libraries are needed is measured, not guessed: a probe interpreter imports
every extension module of lib-dynload and lists the files mapped into its memory
(/proc/self/maps). The probe runs once per interpreter and process.
"""

from __future__ import annotations

import functools
import json
import os
import struct
import subprocess
from dataclasses import dataclass

# Runs outside the sandbox, as the evaluator; trusted code only (the stdlib's own modules).
_PROBE = r"""
import importlib, json, os, sys, sysconfig
# Each bind costs bwrap about a millisecond per run. Left out: Tk, curses and readline (no
# display, no terminal in the sandbox), nis (a network client, gone in 3.13), test modules.
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


@dataclass(frozen=True)
class PythonView:
    executable: str  # the interpreter's real path, as run inside the sandbox
    bwrap_args: tuple[str, ...]  # --ro-bind / --symlink arguments that build the view


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
    dirs = [d for d in found["dirs"] if os.path.isdir(d)]
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
    return PythonView(exe, tuple(view.args))


class _View:
    """Collects bwrap arguments; recreates each symlink on a path once, binds each real path once."""

    def __init__(self) -> None:
        self.args: list[str] = []
        self._links: set[str] = set()
        self._bound: set[str] = set()
        self._dirs: set[str] = set()

    def symlink(self, target: str, path: str) -> None:
        if path not in self._links:
            self._links.add(path)
            self._parents(path)
            self.args += ["--symlink", target, path]

    def expose(self, path: str) -> None:
        real = self._walk(path)
        if real in self._bound or _under(real, self._bound):
            return
        self._parents(real)
        self._bound.add(real)
        self.args += ["--ro-bind", real, real]

    def _parents(self, path: str) -> None:
        """Create the folders above `path` (a path without symlinks) world-searchable: bwrap
        would make them 0700, closing them to the throwaway uid of a root evaluator."""
        missing, parent = [], os.path.dirname(path)
        while parent != "/" and parent not in self._dirs and not _under(parent, self._bound):
            missing.append(parent)
            parent = os.path.dirname(parent)
        for d in reversed(missing):
            self._dirs.add(d)
            self.args += ["--perms", "0755", "--dir", d]

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


def _under(path: str, roots) -> bool:
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
