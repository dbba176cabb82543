"""`exp report DIR [--out FILE]`: the report of a matrix's run folder as one self-contained HTML page.

The command checks what it was given before it draws anything (a folder that `exp run` wrote, an --out that
can be written), and writes the page atomically: a failed report leaves no half page behind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from tunelab.errors import UserError


def check_matrix_dir(matrix_dir: Path) -> None:
    if not matrix_dir.exists():
        raise UserError("no such run folder; give runs/<matrix>, the folder `exp run` writes", file=matrix_dir)
    if not matrix_dir.is_dir():
        raise UserError("not a folder; give runs/<matrix>, the folder `exp run` writes", file=matrix_dir)
    if not (matrix_dir / "cells.json").is_file() and not any(matrix_dir.glob("*/cell.json")):
        raise UserError("not a matrix run folder: it holds neither cells.json nor cell folders "
                        "(<slug>-<id>/cell.json); give runs/<matrix>, the folder `exp run` writes "
                        "(runs/ itself holds one such folder per matrix)", file=matrix_dir)


def check_out(out: Path) -> None:
    """--out must name a file in a folder this process can write (made if missing, under a writable one)."""
    if out.is_dir():
        raise UserError("--out names a folder; give a file name such as report.html", file=out)
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"--out cannot be written: {parent} is a file, not a folder", file=out)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--out cannot be written: no permission to write in {parent}", file=out)


def report_cmd(
    matrix_dir: Annotated[Path, typer.Argument(help="runs/<matrix> folder")],
    out: Annotated[Path | None, typer.Option("--out", help="the HTML file to write (default: DIR/report.html)")]
    = None,
) -> None:
    """Write one self-contained HTML page of a matrix's results: leaderboard, loss curves, memory and speed
    bars, and the provenance of every score."""
    from tunelab.report.html import page
    from tunelab.report.records import collect
    from tunelab.store import write_text

    check_matrix_dir(matrix_dir)
    out = out if out is not None else matrix_dir / "report.html"
    check_out(out)
    text = page(matrix_dir, collect(matrix_dir))
    try:
        write_text(out, text)
    except OSError as e:  # what os.access cannot foresee: a read-only file system, a full disk
        raise UserError(f"--out cannot be written: {e.strerror or e}", file=out) from None
    print(f"wrote {out} ({len(text.encode()) / 1024:.0f} KB)")
