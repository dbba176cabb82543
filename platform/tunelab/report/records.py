"""The cells of a runs/<matrix>/ folder as records: config, state, scores and training figures, read from files."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tunelab import folders
from tunelab.report.scores import Score
from tunelab.store import cell_dirs, read_json, read_jsonl, read_status

TRAIN_FIGURES = {  # train/summary.json key -> column header, and whether higher is better
    "final_loss": ("train loss", False),
    "tokens_per_s": ("tok/s", True),
    "peak_mem_mb": ("peak MB", False),
    "predicted_peak_mb": ("predicted MB", None),  # exp memory's prediction: not better or worse, a check
    "train_seconds": ("train s", False),
}


@dataclass
class Record:
    dir: Path
    slug: str
    id: str
    eval_id: str | None
    varying: dict
    config: dict  # config.yaml, flattened to dotted keys
    state: str
    scores: dict[str, Score] = field(default_factory=dict)
    train: dict = field(default_factory=dict)  # train/summary.json
    results: dict = field(default_factory=dict)  # the evaluation's results.json (provenance, versions)
    env: dict = field(default_factory=dict)

    def metrics(self) -> list[dict]:
        return read_jsonl(self.dir / "train" / "metrics.jsonl")


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "kwargs" and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _entries(matrix_dir: Path) -> list[tuple[Path, dict]]:
    """(cell folder, {id, eval_id, slug, varying}) for each cell of the matrix as last run (cells.json); for a
    runs folder without one, every cell folder with its newest evaluation."""
    index = read_json(matrix_dir / "cells.json")
    if index is None:
        return [(d, {**(read_json(d / "cell.json") or {}), "eval_id": None}) for d in cell_dirs(matrix_dir)]
    return [(d, entry) for entry in index if (d := folders.find(matrix_dir, entry["id"])) is not None]


def _state(d: Path, eval_id: str | None) -> str:
    state = read_status(d).get("state", "?")
    if state == "done" and eval_id is not None and not folders.eval_done(d, eval_id):
        return "pending"  # trained, but not yet evaluated as the matrix now asks
    return state


def read(d: Path, meta: dict) -> Record:
    results = folders.results(d, meta.get("eval_id"))
    try:
        config = flatten(yaml.safe_load((d / "config.yaml").read_text()) or {})
    except (OSError, yaml.YAMLError):
        config = {}
    return Record(dir=d, slug=meta.get("slug", d.name), id=meta.get("id", ""), eval_id=meta.get("eval_id"),
                  varying=meta.get("varying", {}), config=config, state=_state(d, meta.get("eval_id")),
                  scores={t: Score.of(t, r) for t, r in (results.get("tasks") or {}).items()},
                  train=read_json(d / "train" / "summary.json") or {}, results=results,
                  env=read_json(d / "env.json") or {})


def collect(matrix_dir: Path) -> list[Record]:
    return [read(d, meta) for d, meta in _entries(matrix_dir)]
