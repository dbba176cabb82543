"""A matrix's run folder, runs/<matrix>/: its cell folders and what `exp run` writes beside them.

    runs/<matrix>/
      matrix.yaml                    the file as last run (with its --set overrides on top)
      source.json                    which matrix file the folder belongs to: its path and content hash
      cells.json                     the cells of the matrix as last run: id, eval id, slug, varying keys
      <slug>-<id>/                   one CellFolder per trained model
      leaderboard.{md,csv,tex,json} report.html
      nodes/node-R/<cell>.log        what nodes R > 0 of a multi-node cell log
      slurm-array-<world>x<nodes>.sbatch   a job array's script (a cell's own job: <cell>/slurm.sbatch)
      tune/studies.json              the searches of its tune: section (tunelab.tune), each a study:
      tune/<study>/trials.json       its trials, rung by rung; tune/optuna.journal: the Optuna studies
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tunelab.core.errors import UserError, did_you_mean
from tunelab.core.files import read_json, write_json, write_text
from tunelab.core.locks import CellLock
from tunelab.folders.cell import LAYOUT, At, CellFolder

REWRITE = "delete it: the next `exp run` of the matrix file writes it again"  # a damaged file of the run folder


class Planned(Protocol):
    """What the folder needs of a planned cell (matrix.Cell)."""

    @property
    def id(self) -> str: ...
    @property
    def eval_id(self) -> str: ...
    @property
    def slug(self) -> str: ...
    @property
    def varying(self) -> dict[str, Any]: ...
    @property
    def dirname(self) -> str: ...
    @property
    def meta(self) -> dict[str, Any]: ...  # what cells.json says of it besides its id (its part in a search)
    @property
    def checkpoints(self) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class MatrixFolder:
    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    index_file = At("cells.json")
    matrix_file = At("matrix.yaml")
    source_file = At("source.json")  # experiment/ownership.py: one matrix file per run folder
    report_file = At("report.html")

    tune_dir = At("tune")  # locked (core.locks) while a runner writes a study
    studies_file = At("tune", "studies.json")
    journal_file = At("tune", "optuna.journal")
    journal_lock_file = At("tune", "optuna.journal.lock")  # Optuna's own lock of the journal (tune/record.py)
    damaged_journal_file = At("tune", "optuna.journal.damaged")  # a journal with a damaged line, moved aside

    def leaderboard_file(self, suffix: str) -> Path:
        return self.path / f"leaderboard.{suffix}"

    def trials_file(self, study: str) -> Path:
        return self.tune_dir / study / "trials.json"

    def slurm_array_script(self, world: int, nnodes: int) -> Path:
        return self.path / f"slurm-array-{world}x{nnodes}.sbatch"

    def cells(self) -> list[CellFolder]:
        """Every cell folder, by name (folders an interrupted `exp clean` renamed aside start with a dot)."""
        found = sorted(p.parent for p in self.path.glob("*/cell.json"))
        return [CellFolder(d) for d in found if not d.name.startswith(".")]

    def is_matrix(self) -> bool:
        return self.index_file.is_file() or bool(self.cells())

    def index(self) -> list[dict[str, Any]] | None:
        """cells.json, or None for a folder whose runner never wrote one."""
        return read_json(self.index_file, list, REWRITE)

    def write_index(self, cells: Iterable[Planned]) -> None:
        """The matrix as last run, so the leaderboard joins each cell's training and its evaluation."""
        write_json(self.index_file, [{"id": c.id, "eval_id": c.eval_id, "slug": c.slug, "varying": c.varying,
                                      **({"checkpoints": c.checkpoints} if c.checkpoints else {}), **c.meta}
                                     for c in cells])

    def write_matrix_file(self, text: str, overrides: dict[str, Any]) -> None:
        """The file as run; --set overrides are written on top, so the folder says how its cells were made."""
        write_text(self.matrix_file, "".join(f"# exp run --set {k}={v}\n" for k, v in overrides.items()) + text)

    def source(self) -> dict[str, Any] | None:
        """source.json: {"file": the matrix file's absolute path, "sha256": its content's hash}; None before any
        `exp run` wrote one."""
        return read_json(self.source_file, dict, REWRITE)

    def claim_lock(self) -> CellLock:
        """Held for the moment a runner checks and writes source.json (runners started together take turns)."""
        return CellLock(self.path)

    def description(self) -> str:
        import yaml

        try:
            return (yaml.safe_load(self.matrix_file.read_text()) or {}).get("description") or ""
        except (OSError, yaml.YAMLError, AttributeError):
            return ""

    def find(self, cell_id: str) -> CellFolder | None:
        """The folder of a trained-model id, adopting a first-layout folder whose config has that id."""
        folders = {f: f.meta() for f in self.cells()}
        for f, meta in folders.items():
            if meta.get("layout") == LAYOUT and meta.get("id") == cell_id:
                return f
        for f, meta in folders.items():
            if meta.get("layout") != LAYOUT and f.config_id() == cell_id:
                f.migrate()
                return f
        return None

    def folder(self, cell: Planned) -> CellFolder:
        """The trained model's id decides the folder: a cell whose slug changed (the matrix grew), or another
        evaluation of the same training, keeps the folder that exists."""
        return self.find(cell.id) or CellFolder(self.path / cell.dirname)

    def node_log(self, folder: CellFolder, node_rank: int) -> Path:
        """Where a node's share of a cell logs: cell.log on node 0; the other nodes write nothing into the cell's
        folder (it may be shared), theirs go to nodes/node-R/<cell>.log."""
        if node_rank == 0:
            return folder.log_file
        path = self.path / "nodes" / f"node-{node_rank}" / f"{folder.path.name}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path


def open_matrix(path: Path, command: str) -> MatrixFolder:
    """A user's path to runs/<matrix>/; UserError saying what it is instead (its parent, a cell, a file)."""
    if not path.exists():
        raise UserError(f"no such run folder; `exp {command}` takes runs/<matrix>, the folder `exp run` writes",
                        file=path)
    if not path.is_dir():
        raise UserError(f"not a folder; `exp {command}` takes runs/<matrix>, the folder `exp run` writes", file=path)
    folder = MatrixFolder(path)
    if folder.is_matrix():
        return folder
    if CellFolder(path).exists():
        raise UserError(f"this is a cell folder, not a matrix's run folder; `exp {command}` takes its parent "
                        f"{path.parent}", file=path)
    inside = sorted(p.name for p in path.iterdir() if MatrixFolder(p).is_matrix()) if path.is_dir() else []
    hint = (f"; it holds the run folders of {', '.join(inside[:8])}: give one of them, e.g. {path / inside[0]}"
            if inside else "")
    raise UserError(f"not a matrix run folder: it holds neither cells.json nor cell folders (<slug>-<id>/cell.json)"
                    f"; `exp {command}` takes runs/<matrix>, the folder `exp run` writes{hint}", file=path)


def find_cells(name: str, runs: Path = Path("runs")) -> list[CellFolder]:
    """The cells a user may mean by `name` as the leaderboard and `exp status` print it: a slug, `matrix/slug`, an
    id or the start of one, under the runs folder (every matrix in it)."""
    matrix, _, slug = name.rpartition("/")
    matrices = [MatrixFolder(runs / matrix)] if matrix else [MatrixFolder(p) for p in sorted(runs.glob("*"))
                                                              if p.is_dir()]
    found = []
    for m in matrices:
        for f in m.cells():
            meta = f.meta()
            ident, cell_slug = str(meta.get("id", "")), str(meta.get("slug", f.path.name))
            if slug in (cell_slug, f.path.name) or (len(slug) >= 4 and ident.startswith(slug)):
                found.append(f)
    return found


def resolve_cell(arg: str, what: str, runs: Path = Path("runs")) -> Path:
    """A cell folder's path as given, else the one cell `arg` names (find_cells); UserError listing the
    candidates when it names several or none."""
    path = Path(arg).expanduser()
    if path.exists() or not runs.is_dir():
        return path
    found = find_cells(arg, runs)
    if len(found) == 1:
        return found[0].path.resolve()
    if found:
        raise UserError(f"{arg!r} names {len(found)} cells; give one of: "
                        + ", ".join(f"{f.label} ({f.path})" for f in found), key=what)
    every = [f.label for p in sorted(runs.glob("*")) if p.is_dir() for f in MatrixFolder(p).cells()]
    names = list(dict.fromkeys(every + [e.rpartition("/")[2] for e in every]))
    raise UserError(f"{arg!r} is no folder, and no cell under {runs}/ has that name or id"
                    + did_you_mean(arg, names)
                    + (f"; cells: {', '.join(every[:12])}" + (" ..." if len(every) > 12 else "") if every else ""),
                    key=what)
