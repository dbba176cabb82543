"""What a user names on the command line when a command takes "a model, a cell, a checkpoint or a folder": one
resolver for `exp eval run`, `exp compare`, `exp export` and `exp chat`.

A name is tried in this order, and the first that holds wins:

    a path that exists        a cell's folder, its final/, one of its checkpoints/step-N, a matrix's run folder,
                              or any folder with a model in it (config.json or adapter_config.json)
    a catalog alias           tiny-random-llama (core.registries.MODELS)
    a cell's name             as the leaderboard and `exp status` print it, under the runs folder: its slug,
                              matrix/slug, its folder's name (slug-id), the start of its id, or a leaderboard row's
                              label (a tuned group's winner, seeds folded)
    a hub id                  org/name (one slash; a name with more is a path that does not exist)

Anything else, or a kind the command does not take, is a UserError that says what the name is and what the
command takes. Two cells of one matrix may share a slug (run again with other --set values): both are then
named by their folder's name, which is unique (`names`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tunelab.core.errors import UserError, did_you_mean
from tunelab.core.paths import HUB_ID, looks_like_path
from tunelab.core.registries import MODELS
from tunelab.folders.cell import STEP_DIR, CellFolder
from tunelab.folders.matrix import MatrixFolder

# What each kind is, in the words an error uses.
KINDS = {
    "cell": "a cell (its folder, its final/, or its name as the leaderboard prints it)",
    "checkpoint": "a cell's checkpoint (runs/<matrix>/<cell>/checkpoints/step-N)",
    "row": "a leaderboard row (runs/<matrix>/<label>: its seeds, paired one by one)",
    "matrix": "a matrix's run folder (runs/<matrix>)",
    "model": "a folder with a model in it (config.json, or adapter_config.json for an adapter)",
    "alias": f"a catalog alias ({', '.join(MODELS)})",
    "hub": "a hub id (org/name)",
}
MODEL_FILES = ("config.json", "adapter_config.json")  # the Hugging Face format's, not tunelab's layout


@dataclass(frozen=True)
class Target:
    kind: str  # one of KINDS
    given: str  # as the user wrote it
    path: Path | None = None  # the folder; a row: runs/<matrix>/<label> (no such folder: report.compare reads it)
    step: int | None = None  # a checkpoint's step

    @property
    def cell(self) -> CellFolder:
        """The cell of a cell or a checkpoint."""
        assert self.path is not None and self.kind in ("cell", "checkpoint"), self
        return CellFolder(self.path if self.kind == "cell" else self.path.parent.parent)

    @property
    def model_name(self) -> str:
        """What models.loading takes: the alias or hub id as given, a folder as an absolute path."""
        return str(self.path) if self.path is not None else self.given


def resolve(arg: str, command: str, accept: Iterable[str], runs: Path = Path("runs")) -> Target:
    """The one thing `arg` names (module docstring), if it is of a kind in `accept`; else a UserError for
    `exp COMMAND` saying what it is and what the command takes."""
    accept = tuple(accept)
    target = _what(arg, command, accept, runs)
    if target.kind not in accept:
        raise UserError(f"this is {KINDS[target.kind]}; `exp {command}` takes {_takes(accept)}", file=arg)
    return target


def _takes(accept: tuple[str, ...]) -> str:
    return "; or ".join(KINDS[k] for k in accept)


def _what(arg: str, command: str, accept: tuple[str, ...], runs: Path) -> Target:
    try:
        path = Path(arg).expanduser()
        exists = path.exists()
    except (OSError, ValueError, RuntimeError):  # a name no path can have (too long, a NUL, ~user unknown)
        path, exists = Path(), False
    if exists:
        return _folder(arg, path.resolve(), command, accept)
    if arg in MODELS:
        return Target("alias", arg)
    if "matrix" in accept and "/" not in arg and MatrixFolder(runs / arg).is_matrix():
        return Target("matrix", arg, (runs / arg).resolve())  # a matrix by its name (`exp compare tiny tiny2`)
    found = find(arg, runs)
    if len(found) == 1:
        return found[0]
    if found:
        raise UserError(f"names {len(found)} cells under {runs}/; give one of: "
                        + ", ".join(_shown(t, runs) for t in found), file=arg)
    if HUB_ID.match(arg) and not looks_like_path(arg) and ({"hub", "alias", "model"} & set(accept)):
        return Target("hub", arg)
    every = [n for m in _matrices(runs) for n in names(m.cells(), qualified=True).values()]
    shorts = list(dict.fromkeys(e.rpartition("/")[2] for e in every))
    what = "no such folder" if looks_like_path(arg) else "no such folder, catalog alias, cell or hub id"
    raise UserError(f"{what}: `exp {command}` takes {_takes(accept)}"
                    + did_you_mean(arg, [*MODELS.names(), *every, *shorts])
                    + (f"; cells under {runs}/: {', '.join(every[:12])}" + (" ..." if len(every) > 12 else "")
                       if every and "cell" in accept else ""), file=arg)


def _folder(arg: str, path: Path, command: str, accept: tuple[str, ...]) -> Target:
    """An existing path: what kind of folder it is."""
    if not path.is_dir():
        raise UserError(f"this is a file; `exp {command}` takes {_takes(accept)}", file=arg)
    if CellFolder(path).exists():
        return Target("cell", arg, path)
    cell = CellFolder(path.parent)
    if cell.exists() and path == cell.final:
        return Target("cell", arg, cell.path)  # final/ is what a cell's name stands for
    owner = CellFolder(path.parent.parent)
    if owner.exists() and path.parent == owner.checkpoints and (m := STEP_DIR.match(path.name)):
        return Target("checkpoint", arg, path, int(m.group(1)))
    if MatrixFolder(path).is_matrix():
        return Target("matrix", arg, path)
    if any((path / f).is_file() for f in MODEL_FILES):
        return Target("model", arg, path)
    raise UserError(f"this folder holds no model (no {' or '.join(MODEL_FILES)}) and is no cell's or matrix's "
                    f"run folder; `exp {command}` takes {_takes(accept)}", file=arg)


def _matrices(runs: Path) -> list[MatrixFolder]:
    try:
        return [MatrixFolder(p) for p in sorted(runs.iterdir()) if p.is_dir()] if runs.is_dir() else []
    except OSError:
        return []


def row_label(slug: str, tune: object, seed: object) -> str:
    """The leaderboard row a cell folds into (report.table and this resolver): a tuned group's winners (its seeds
    and its studies) into `<group>-tuned`, any other cell's seeds into its slug without them (`seed`: its
    train.seed when the matrix varies it, else None)."""
    if isinstance(tune, dict) and tune.get("role") == "tuned" and tune.get("group"):
        return f"{tune['group']}-tuned"
    return (slug.removesuffix(f"-s{seed}") or slug) if seed is not None else slug


def find(name: str, runs: Path = Path("runs")) -> list[Target]:
    """Every cell (or leaderboard row) under the runs folder that `name` may mean (module docstring), one each."""
    matrix, _, short = name.rpartition("/")
    if not short:
        return []
    # matrix/slug under the runs folder, or runs/<matrix>/<label> as a path (a row's label is no folder)
    within = next((Path(d) for d in (runs / matrix, Path(matrix).expanduser()) if matrix and Path(d).is_dir()), None)
    matrices = [MatrixFolder(within)] if within else [] if matrix else _matrices(runs)
    found: dict[Path, Target] = {}
    for m in matrices:
        for f in m.cells():
            meta = f.meta()
            ident, slug = str(meta.get("id", "")), str(meta.get("slug", f.path.name))
            if short in (slug, f.path.name) or (len(short) >= 4 and ident.startswith(short)):
                found.setdefault(f.path.resolve(), Target("cell", name, f.path.resolve()))
        rows: dict[str, list[dict]] = {}
        for entry in m.index() or []:  # the leaderboard's labels: a tuned winner lives in its trial's folder
            if isinstance(entry, dict) and isinstance(entry.get("slug"), str):
                rows.setdefault(entry["slug"], []).append(entry)
                seed = (entry.get("varying") or {}).get("train.seed")
                if (label := row_label(entry["slug"], entry.get("tune"), seed)) != entry["slug"]:
                    rows.setdefault(label, []).append(entry)
        entries = rows.get(short, [])
        if len(entries) == 1 and (winner := m.find(str(entries[0].get("id")))) is not None:
            found.setdefault(winner.path.resolve(), Target("cell", name, winner.path.resolve()))
        elif len(entries) > 1:
            found.setdefault((m.path / short).resolve(), Target("row", name, m.path.resolve() / short))
    return list(found.values())


def _shown(t: Target, runs: Path) -> str:
    if t.kind == "row":
        assert t.path is not None
        return f"{t.path.parent.name}/{t.path.name} (a leaderboard row of several seeds)"
    return f"{t.cell.path.parent.name}/{t.cell.path.name}"


def names(cells: Iterable[CellFolder], qualified: bool = False) -> dict[Path, str]:
    """How to call each cell so that no two share a name: its slug (matrix/slug when `qualified`), or its
    folder's name where another cell of the same matrix has the same slug (a run with other --set values)."""
    cells = list(cells)
    slug = {c.path: str(c.meta().get("slug", c.path.name)) for c in cells}
    count: dict[tuple[Path, str], int] = {}
    for c in cells:
        count[(c.path.parent, slug[c.path])] = count.get((c.path.parent, slug[c.path]), 0) + 1
    out = {}
    for c in cells:
        short = slug[c.path] if count[(c.path.parent, slug[c.path])] == 1 else c.path.name
        out[c.path] = f"{c.meta().get('matrix', c.path.parent.name)}/{short}" if qualified else short
    return out
