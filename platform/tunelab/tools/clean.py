"""`exp clean DIR [--checkpoints] [--failed]`: free the disk that finished work no longer needs.

--checkpoints removes checkpoints/ of done cells (they exist to resume, and a done cell never resumes; final/
and the results stay). --failed removes failed cells' folders, so the next `exp run` starts them afresh.
A locked cell (a process works in it) is never touched: the lock is taken for the deletion itself, and the
target is first renamed aside (and a cell folder loses its cell.json), so an interrupted clean never leaves
something that looks like a checkpoint or a cell.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tunelab.core.errors import UserError
from tunelab.core.locks import Locked, lock
from tunelab.folders.cell import CellFolder
from tunelab.folders.matrix import MatrixFolder
from tunelab.folders.targets import names


@dataclass(frozen=True)
class Item:
    cell: CellFolder
    label: str  # matrix/slug
    state: str
    target: Path  # what goes: the cell's checkpoints/ or the whole cell folder
    size: int  # bytes in its files
    skip: str | None = None  # why it is left alone


def find_cells(root: Path) -> list[CellFolder]:
    """DIR may be a cell folder, runs/<matrix>/ or runs/."""
    if not root.is_dir():
        raise UserError("no such folder; expected runs/, runs/<matrix>/ or a cell folder", file=root)
    if CellFolder(root).meta_file.is_file():
        return [CellFolder(root)]
    cells = MatrixFolder(root).cells() or [c for m in sorted(root.iterdir()) if m.is_dir()
                                           for c in MatrixFolder(m).cells()]
    if not cells:
        raise UserError("no cell folders here (a cell folder has cell.json); expected runs/, runs/<matrix>/ or "
                        "a cell folder", file=root)
    return cells


def plan(root: Path, *, checkpoints: bool, failed: bool) -> list[Item]:
    items = []
    cells = find_cells(root)
    label = names(cells, qualified=True)  # a slug two cells share: their folders' names
    for cell in cells:
        state = cell.status().get("state", "?")
        if checkpoints and state == "done" and cell.checkpoints.is_dir():
            target = cell.checkpoints
        elif failed and state == "failed":
            target = cell.path
        else:
            continue
        skip = "locked: a process is working in it" if cell.is_locked() else None
        items.append(Item(cell, label[cell.path], state, target, cell.disk_usage(target), skip))
    return items


def delete(item: Item) -> bool:
    """Delete one item under its cell's lock; False if a process took the lock since the plan was made."""
    try:
        with lock(item.cell.path):
            if item.cell.status().get("state") != item.state:  # it changed since the plan: leave it
                return False
            aside = item.target.with_name(f".{item.target.name}.deleting")
            os.replace(item.target, aside)
            CellFolder(aside).meta_file.unlink(missing_ok=True)
            shutil.rmtree(aside)
    except Locked:
        return False
    return True


def refresh_leaderboards(items: list[Item]) -> None:
    """A removed failed cell must leave the leaderboard files too."""
    from tunelab.report import leaderboard

    for mdir in {i.cell.path.parent for i in items if i.target == i.cell.path}:
        if MatrixFolder(mdir).leaderboard_file("md").is_file():
            leaderboard.write(mdir)
