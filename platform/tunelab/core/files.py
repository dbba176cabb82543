"""Atomic writes and per-folder locks: how every tunelab file survives a crash (the layouts live in
folders/cell.py and folders/matrix.py).

What a crash can leave behind, and why none of it is trusted: files are written to a temporary sibling and
renamed (a reader sees the old file or the new one, never half of one); JSON-lines files are appended one
record at a time and a record torn by a crash is dropped on read and cut off before the next append; a cell
folder is worked in only under its flock, which the kernel releases when the holder dies, so a status that
still says "running" under a free lock belongs to a dead process (`live_state`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from tunelab.core.errors import UserError

# Errors of the place, not of tunelab: they become one clear message (exit 2), not a traceback.
_PLACE_ERRORS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                 errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                 errno.EPERM: "operation not permitted"}


class WriteFailed(UserError):
    """A file could not be written where the user asked for it (full disk, read-only, no permission)."""


def _write_failed(path: Path, e: OSError) -> WriteFailed:
    what = _PLACE_ERRORS.get(e.errno or 0, e.strerror)
    return WriteFailed(f"cannot write here: {what} ({e.strerror}); nothing was half-written. Free space or choose "
                       "another folder (exp run --runs-dir DIR), then run again", file=path)


def make_dir(path: Path, what: str = "") -> Path:
    """mkdir -p, with the place's errors said in words (`what`: how the user named the folder, e.g. an option
    or an environment variable)."""
    named = f" ({what})" if what else ""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise WriteFailed(f"not a folder{named}: it, or a folder above it, is a file", file=path) from None
    except OSError as e:
        if e.errno in _PLACE_ERRORS:
            raise _write_failed(path, e) from None
        if e.errno == errno.ENOENT:  # a parent that exists yet takes no new folder: /proc, /sys, some mounts
            above = next((p for p in path.absolute().parents if p.exists()), Path("/"))
            raise WriteFailed(f"cannot make this folder{named}: {above} exists but takes no new folders "
                              f"({e.strerror}; a system folder such as /proc or /sys, or a mount that refuses "
                              "them); choose a folder you can write, then run again", file=path) from None
        raise
    return path


def write_text(path: Path, text: str) -> None:
    """Temp file + rename: a reader never sees half a file, a crash never leaves one."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno in _PLACE_ERRORS:
            raise _write_failed(path, e) from None
        raise


@contextmanager
def atomic_dir(dest: Path) -> Iterator[Path]:
    """Build a folder under a temporary sibling name; it takes its real name only once the block ends without
    an error, so a killed build leaves nothing a later reader would trust. Two processes building the same
    folder (a cache entry) both succeed: the first rename wins, the second's equal result is dropped."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-"))
    try:
        yield tmp
        try:
            os.replace(tmp, dest)
        except OSError:
            if not dest.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def write_yaml(path: Path, obj: Any) -> None:
    write_text(path, yaml.safe_dump(obj, sort_keys=False))


def read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def append_jsonl(path: Path, record: dict) -> None:
    """One record, one line. A line a crash tore (no newline at its end) is cut off first, so its half never
    runs into the next record."""
    with path.open("ab") as f:
        if f.tell() and _last_byte(path) != b"\n":
            f.truncate(path.read_bytes().rfind(b"\n") + 1)  # rfind is -1 without any newline: empty file
        f.write((json.dumps(record, default=str) + "\n").encode())


def _last_byte(path: Path) -> bytes:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def read_jsonl(path: Path, *, appended: bool = True) -> list[dict]:
    """Every record of a JSON-lines file. `appended` (tunelab's own logs, written by append_jsonl): a last line
    without its newline is a record a crash tore while it was being appended, and is left out; a missing file
    has no records. Otherwise (a user's data file) every line counts. Any other line that is not JSON is
    damage or a mistake: ValueError naming the line."""
    if appended and not path.is_file():
        return []
    lines = path.read_text().split("\n")
    if appended:
        lines = lines[:-1]  # "" when the file ends with a newline, else the torn record
    out = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {n} is not JSON ({e.msg})") from None
    return out
