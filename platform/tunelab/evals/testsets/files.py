"""Where offline eval data lives and how its JSON-lines files are read and written (sources.py, pull.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tunelab.core.errors import UserError
from tunelab.core.files import write_text
from tunelab.core.paths import cache_dir


def cache_root() -> Path:
    return cache_dir() / "eval-data"


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a JSON-lines test file; a line that is not JSON is the user's file to fix, said so."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise UserError(f"line {n} is not JSON ({e.msg}, column {e.colno})", file=path) from None
    return rows


def write_jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
