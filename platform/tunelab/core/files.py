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
import re
import resource
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from tunelab.core.errors import UserError

# Errors of the place, not of tunelab: they become one clear message (exit 2), not a traceback.
PLACE_ERRORS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                 errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                 errno.EPERM: "operation not permitted",
                 errno.EFBIG: "file larger than this process may write (ulimit -f)"}
RUNS_DIR_ADVICE = "choose another folder (exp run --runs-dir DIR)"
CACHE_ADVICE = "point TUNELAB_CACHE at a writable folder (the cache: $TUNELAB_CACHE, else ~/.cache/tunelab)"


class WriteFailed(UserError):
    """A file could not be written where the user asked for it (full disk, read-only, no permission, a file size
    limit). `cause` is the limit in words, for status.json."""

    def __init__(self, message: str, *, file: str | Path | None = None, cause: str = "the write failed"):
        super().__init__(message, file=file)
        self.cause = cause


def _advice(path: Path) -> str:
    """How to choose another place for `path`: the cache has its variable, the rest is a runs folder."""
    from tunelab.core.paths import cache_dir

    try:
        inside = Path(os.path.abspath(path)).is_relative_to(os.path.abspath(cache_dir()))
    except (OSError, RuntimeError):  # no home to find ~/.cache in
        inside = False
    return CACHE_ADVICE if inside else RUNS_DIR_ADVICE


def cannot_write(path: Path, e: OSError, advice: str | None = None) -> WriteFailed:
    """The paragraph for a write the place refused (PLACE_ERRORS), with how to choose another place."""
    advice = advice or _advice(path)
    what = PLACE_ERRORS.get(e.errno or 0, e.strerror or str(e))
    return WriteFailed(f"cannot write here: {what} ({e.strerror}); nothing was half-written. Free space or "
                       f"{advice}, then run again", file=path, cause=what)


def write_failure(e: BaseException, path: Path | None = None) -> str | None:
    """The place's limit a failed write met, in words (a full disk, a quota, a read-only folder, `ulimit -f`), or
    None when `e` is not a failed write. torch says only "file write failed" (its C++ writer keeps no errno), so
    for it the limits are looked at: the file size limit, then the free space where it wrote (`path`)."""
    for err in (e, e.__cause__, e.__context__):
        if isinstance(err, WriteFailed):
            return err.cause
        if isinstance(err, OSError) and err.errno in PLACE_ERRORS:
            return PLACE_ERRORS[err.errno]
    # Rust writers (safetensors) keep the errno in their text: "I/O error: File too large (os error 27)"
    found = re.search(r"\(os error (\d+)\)", str(e))
    if found and int(found.group(1)) in PLACE_ERRORS:
        return PLACE_ERRORS[int(found.group(1))]
    # torch's zip writer: "file write failed", or, when a short write went unseen, "unexpected pos N vs M"
    if not (isinstance(e, RuntimeError) and any(w in str(e) for w in ("write", "inline_container"))):
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        return f"{PLACE_ERRORS[errno.EFBIG]}: {soft} bytes"
    where = path
    while where is not None and not where.exists() and where != where.parent:
        where = where.parent
    try:
        st = os.statvfs(where or ".")
    except OSError:
        return None
    if st.f_bavail * st.f_frsize < 1 << 20:
        return PLACE_ERRORS[errno.ENOSPC]
    return None if os.access(where or ".", os.W_OK) else PLACE_ERRORS[errno.EACCES]  # no limit: another fault


def make_dir(path: Path, what: str = "", advice: str | None = None) -> Path:
    """mkdir -p, with the place's errors said in words (`what`: how the user named the folder, e.g. an option
    or an environment variable; `advice`: how to choose another one)."""
    named = f" ({what})" if what else ""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise WriteFailed(f"not a folder{named}: it, or a folder above it, is a file", file=path) from None
    except OSError as e:
        if e.errno in PLACE_ERRORS:
            raise cannot_write(path, e, advice) from None
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
        if isinstance(e, OSError) and e.errno in PLACE_ERRORS:
            raise cannot_write(path, e) from None
        raise


@contextmanager
def atomic_dir(dest: Path) -> Iterator[Path]:
    """Build a folder under a temporary sibling name; it takes its real name only once the block ends without
    an error, so a killed build leaves nothing a later reader would trust. Two processes building the same
    folder (a cache entry) both succeed: the first rename wins, the second's equal result is dropped."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-"))
    except OSError as e:  # a read-only or full cache on a cache miss: said, with the variable to set
        raise (cannot_write(dest, e) if e.errno in PLACE_ERRORS else e) from None
    try:
        yield tmp
        try:
            os.replace(tmp, dest)
        except OSError:
            if not dest.is_dir():
                raise
    except OSError as e:
        raise (cannot_write(dest, e) if e.errno in PLACE_ERRORS else e) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def write_yaml(path: Path, obj: Any) -> None:
    write_text(path, yaml.safe_dump(obj, sort_keys=False))


class StateFileDamaged(UserError):
    """A file tunelab wrote that cannot be used as it is (not UTF-8, not JSON, the wrong shape, unreadable)."""


def _kind(t: type | tuple[type, ...]) -> str:
    names = {dict: "object", list: "list", str: "string", int: "number", float: "number", bool: "boolean"}
    types = t if isinstance(t, tuple) else (t,)
    return " or ".join(dict.fromkeys(names.get(x, x.__name__) for x in types))


def read_json(path: Path, shape: type | tuple[type, ...] = object, fix: str | None = None) -> Any | None:
    """The one reader of tunelab's JSON state files. A missing file is None. A file that is not UTF-8, not JSON
    or not of the `shape` tunelab writes (an object, a list) is damage: with `fix` (what the user should do: "delete
    it: `exp run` writes it again"), the one-paragraph error naming the file, what is wrong and `fix`; without it,
    None, for a file whose absence is itself handled (a results.json read as missing is evaluated again, a cache is
    built again). A file the system will not let us read (a folder, no permission) is always the paragraph."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StateFileDamaged(f"cannot read this file: {e.strerror or e}; check it and its permissions, then run "
                               "again", file=path) from None
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        problem = f"is not UTF-8 text (byte {e.start}: {e.reason})"
    except json.JSONDecodeError as e:
        problem = f"is not valid JSON ({e.msg}: line {e.lineno}, column {e.colno})"
    except RecursionError:
        problem = "is nested too deeply to read"
    else:
        if isinstance(value, shape):
            return value
        problem = f"holds a JSON {_kind(type(value))} where tunelab writes a JSON {_kind(shape)}"
    if fix is None:
        return None
    raise StateFileDamaged(f"this file {problem}: it was damaged or edited since tunelab wrote it. {fix}", file=path)


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


def warn(text: str) -> None:
    """A warning on stderr (a cell's goes to its cell.log)."""
    print(f"warning: {text}", file=sys.stderr, flush=True)


def read_jsonl(path: Path, *, appended: bool = True, on_damage: Callable[[str], None] = warn) -> list[dict]:
    """Every record of a JSON-lines file. `appended` (tunelab's own logs, written by append_jsonl): a last line
    without its newline is a record a crash tore while it was being appended, and is left out; a missing file
    has no records; a line in the middle that is not a JSON object (not UTF-8, not JSON: damage since) is left
    out too, said by `on_damage` with the file and the line. Otherwise (a user's data file) every line counts,
    and one that is not JSON is a mistake: ValueError naming the line."""
    if appended and not path.is_file():
        return []
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as e:
        raise StateFileDamaged(f"cannot read this file: {e.strerror or e}; check it and its permissions",
                               file=path) from None
    if appended:
        lines = lines[:-1]  # b"" when the file ends with a newline, else the torn record
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            why = f"not UTF-8 (byte {e.start})" if isinstance(e, UnicodeDecodeError) else f"not JSON ({e.msg})"
            if not appended:
                raise ValueError(f"{path}: line {n} is {why}") from None
            on_damage(f"{path}: line {n} is {why}: left out (damaged since it was written)")
            continue
        if appended and not isinstance(record, dict):
            on_damage(f"{path}: line {n} is not a JSON object: left out (damaged since it was written)")
            continue
        out.append(record)
    return out
