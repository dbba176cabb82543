"""One runs folder, one matrix file: runs/<name>/ belongs to the file that first ran there (source.json: its path
and content hash). Another file that has the same `name:` and other content is refused at plan and run time, with
both paths (exit 2), unless `exp run --replace` makes it the folder's file: two files' cells never mix in one
folder, cells.json and leaderboard. The same file edited (same path) and a copy of it (same content) are the same
matrix. Runners started together check and claim under the folder's claim lock, so only one file wins.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

from tunelab.core.errors import UserError
from tunelab.core.files import write_json
from tunelab.folders.matrix import MatrixFolder


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def refuse(folder: MatrixFolder, file: Path, text: str) -> None:
    """UserError when the folder belongs to another matrix file with other content; nothing is written."""
    owner = folder.source()
    if owner is None:  # a new folder, or one written before source.json: the first `exp run` claims it
        return
    path, digest = str(owner.get("file", "")), owner.get("sha256")
    if path == str(file.resolve()) or digest == _digest(text):
        return
    raise UserError(
        f"the run folder {folder.path} belongs to another matrix file, {path}, which has the same name "
        f"({folder.name!r}) and other content; run here, their cells would mix in one folder and one leaderboard. "
        f"Give this file another `name:`, run it with --runs-dir DIR, or pass --replace to make this file the "
        f"folder's matrix (the other file's cell folders stay, and leave its leaderboard)", file=file)


def claim(folder: MatrixFolder, file: Path, text: str, replace: bool, say: Callable[[str], None]) -> None:
    """At run time, before the first file is written: refuse (unless `replace`) or make the folder this file's."""
    held = folder.claim_lock()
    held.acquire_saying(say, f"waiting for the process that holds the run folder's lock {held.path}")
    with held:
        if not replace:
            refuse(folder, file, text)
        owner = None if replace else folder.source()
        if owner is None or owner.get("file") != str(file.resolve()) or owner.get("sha256") != _digest(text):
            write_json(folder.source_file, {"file": str(file.resolve()), "sha256": _digest(text),
                                            "since": time.strftime("%Y-%m-%d %H:%M:%S %z")})
