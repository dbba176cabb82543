"""What a tuned row cost: the device-hours of every run of its cells (each cell's attempts.jsonl: seconds from the
cell's start to its end, times the devices it held), split into its search (every trial of every study, at every
rung it ran to) and its retraining (each study's winner trained with the other seeds and evaluated on the suite).

Measured, not planned: a run killed with its runner (kill -9) left no end to measure and is not counted; a process's
start (the interpreter and its imports, before the cell writes `running`) is not counted either. On a CPU a process
counts as one device whatever its threads (CPU-hours); on GPUs, each GPU of its layout.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunelab.core.files import read_json
from tunelab.folders.cell import CellFolder
from tunelab.folders.matrix import MatrixFolder


@dataclass
class Cost:
    search_s: float = 0.0  # device-seconds of the trials' runs
    retrain_s: float = 0.0  # of the winners' retraining and their evaluation on the suite
    by_rung: dict[int, float] = field(default_factory=dict)  # search device-seconds by the step a run stopped at
    studies: int = 0
    runs: int = 0  # ended runs counted
    devices: set[str] = field(default_factory=set)  # cpu, cuda

    @property
    def unit(self) -> str:
        return "CPU-h" if self.devices <= {"cpu"} else "GPU-h" if self.devices == {"cuda"} else "device-h"

    def hours(self, seconds: float) -> float:
        return seconds / 3600

    def text(self) -> str:
        """'0.31 CPU-h (search 0.27, retraining 0.04)'."""
        total = self.hours(self.search_s + self.retrain_s)
        return (f"{total:.3g} {self.unit} (search {self.hours(self.search_s):.3g}, retraining "
                f"{self.hours(self.retrain_s):.3g})")


class Folders:
    """Cell folders of one runs folder by id, read once (a search's trials are named by id in trials.json)."""

    def __init__(self, matrix_dir: Path):
        self.matrix_dir = matrix_dir
        self._by_id = {f.meta().get("id"): f for f in MatrixFolder(matrix_dir).cells()}

    def get(self, cell_id: str | None) -> CellFolder | None:
        return self._by_id.get(cell_id)


def _add(cost: Cost, attempt: dict[str, Any]) -> float:
    cost.runs += 1
    cost.devices.add(str(attempt.get("device") or "cpu"))
    return float(attempt.get("seconds") or 0.0) * int(attempt.get("devices") or 1)


def of_row(tune_metas: list[dict[str, Any]], finals: list[Path], folders: Folders) -> Cost:
    """The cost of a tuned row: `tune_metas` its cells' word on their search (cells.json: each names its study's
    trials.json), `finals` its cells' folders (each study's winner, once per seed)."""
    cost = Cost()
    trial_dirs: dict[Path, None] = {}
    studies = {m.get("trials_file") for m in tune_metas if m.get("trials_file")}
    cost.studies = len(studies)
    for rel in sorted(studies):  # type: ignore[type-var]
        table = read_json(folders.matrix_dir / str(rel), dict) or {}  # damaged: no cost to read from it
        full = max((r for b in table.get("schedule", []) for r in b.get("rungs", [])), default=None)
        for t in table.get("trials", []):
            f = folders.get(t.get("cell"))
            if f is not None and f.path not in trial_dirs:
                trial_dirs[f.path] = None
                for a in f.attempts():
                    if a.get("evaluating_only"):
                        continue  # a winner's evaluation on the suite: its retraining's share
                    seconds = _add(cost, a)
                    cost.search_s += seconds
                    step = a.get("paused_at") or full or 0
                    cost.by_rung[int(step)] = cost.by_rung.get(int(step), 0.0) + seconds
    for path in dict.fromkeys(finals):
        for a in CellFolder(path).attempts():
            if path in trial_dirs and not a.get("evaluating_only"):
                continue  # the winning trial's training: counted in the search
            cost.retrain_s += _add(cost, a)
    return cost


def by_group(costs: dict[str, Cost]) -> list[dict[str, Any]]:
    """The report's table: per method group, what its search and retraining cost and where (by rung)."""
    rows = []
    for group, c in costs.items():
        rungs = defaultdict(float, c.by_rung)
        rows.append({"group": group, "studies": c.studies, "runs": c.runs,
                     f"search {c.unit}": round(c.hours(c.search_s), 4),
                     f"retraining {c.unit}": round(c.hours(c.retrain_s), 4),
                     f"total {c.unit}": round(c.hours(c.search_s + c.retrain_s), 4),
                     "search by rung (step: hours)": ", ".join(f"{s}: {c.hours(v):.3g}"
                                                               for s, v in sorted(rungs.items()))})
    return rows
