"""The run store: runs/<matrix>/<cell>/ layout, atomic writes, per-cell locks, status files."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

STATES = ("pending", "running", "done", "failed")


def write_text(path: Path, text: str) -> None:
    """Temp file + rename: a reader never sees half a file, a crash never leaves one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
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
    with path.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_status(run_dir: Path) -> dict:
    return read_json(run_dir / "status.json") or {}


def write_status(run_dir: Path, state: str, **fields: Any) -> dict:
    """Merge into status.json, keeping earlier fields (timings) unless overwritten."""
    assert state in STATES, state
    status = {**read_status(run_dir), **fields, "state": state, "updated_at": time.time()}
    if state in ("pending", "running"):
        status.pop("error", None)
    write_json(run_dir / "status.json", status)
    return status


class Locked(Exception):
    pass


@contextmanager
def lock(run_dir: Path) -> Iterator[None]:
    """An exclusive lock on a cell directory while a process works in it (released if it dies)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / ".lock").open("w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Locked(str(run_dir)) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def is_locked(run_dir: Path) -> bool:
    if not (run_dir / ".lock").exists():
        return False
    try:
        with lock(run_dir):
            return False
    except Locked:
        return True


def cell_dirs(matrix_dir: Path) -> list[Path]:
    return sorted(p.parent for p in matrix_dir.glob("*/cell.json"))
