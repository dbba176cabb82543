"""Where offline eval data lives and how its JSON-lines files are read and written (sources.py, pull.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tunelab.paths import cache_dir
from tunelab.store import write_text


def cache_root() -> Path:
    return cache_dir() / "eval-data"


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
