"""The cells of a runs/<matrix>/ folder as records: config, state, scores and training figures, read from files."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tunelab.cellfolder import CellFolder
from tunelab.matrixfolder import MatrixFolder
from tunelab.report.scores import Score

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

    @property
    def folder(self) -> CellFolder:
        return CellFolder(self.dir)

    def metrics(self) -> list[dict]:
        return self.folder.metrics()


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "kwargs" and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _entries(matrix: MatrixFolder) -> list[tuple[CellFolder, dict]]:
    """(cell folder, {id, eval_id, slug, varying}) for each cell of the matrix as last run (cells.json); for a
    runs folder without one, every cell folder with its newest evaluation."""
    index = matrix.index()
    if index is None:
        return [(f, {**f.meta(), "eval_id": None}) for f in matrix.cells()]
    return [(f, entry) for entry in index if (f := matrix.find(entry["id"])) is not None]


def _state(f: CellFolder, eval_id: str | None) -> str:
    state = f.status().get("state", "?")
    if state == "done" and eval_id is not None and not f.eval_done(eval_id):
        return "pending"  # trained, but not yet evaluated as the matrix now asks
    return state


def read(f: CellFolder, meta: dict) -> Record:
    results = f.results(meta.get("eval_id"))
    return Record(dir=f.path, slug=meta.get("slug", f.path.name), id=meta.get("id", ""), eval_id=meta.get("eval_id"),
                  varying=meta.get("varying", {}), config=flatten(f.raw_config()), state=_state(f, meta.get("eval_id")),
                  scores={t: Score.of(t, r) for t, r in (results.get("tasks") or {}).items()},
                  train=f.summary(), results=results, env=f.env())


def collect(matrix_dir: Path) -> list[Record]:
    return [read(f, meta) for f, meta in _entries(MatrixFolder(matrix_dir))]
