"""The cells of a runs/<matrix>/ folder as records: config, state, scores and training figures, read from files."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from tunelab.folders.cell import CellFolder
from tunelab.folders.matrix import MatrixFolder
from tunelab.report.scores import Score

TRAIN_FIGURES = {  # train/summary.json key (or one `read` adds) -> column header, and whether higher is better
    "final_loss": ("train loss", False),
    "tokens_per_s": ("tok/s", True),
    "peak_mem_mb": ("peak MB", False),
    "predicted_peak_mb": ("predicted MB", None),  # exp memory's prediction: not better or worse, a check
    "train_seconds": ("train s", False),
    "final_step": ("final/ from step", None),  # the checkpoint train.select made final/ (train/selection.json)
    "scored_step": ("scored at step", None),  # the checkpoint whose scores the row shows (--at-step, --best)
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
    tune: dict = field(default_factory=dict)  # cells.json's word on its part in a search (tunelab.tune)
    curve: dict[int, dict[str, Score]] = field(default_factory=dict)  # step -> task -> score (eval.checkpoints)

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


def _state(f: CellFolder, meta: dict) -> str:
    state, eval_id, ck = f.status().get("state", "?"), meta.get("eval_id"), meta.get("checkpoints") or {}
    if state == "done" and eval_id is not None and not f.eval_done(eval_id):
        return "pending"  # trained, but not yet evaluated as the matrix now asks
    if state == "done" and not all(f.step_results(ck["eval_id"], s).get("complete") for s in ck.get("steps", [])):
        return "pending"  # and its checkpoints not yet
    return state


def scores_of(results: dict) -> dict[str, Score]:
    return {t: Score.of(t, r) for t, r in (results.get("tasks") or {}).items()}


def _curve(f: CellFolder, meta: dict) -> dict[int, dict[str, Score]]:
    """The checkpoints' scores of the cell's checkpoint evaluation (cells.json names it; a folder without one:
    its own config's)."""
    eval_id = (meta.get("checkpoints") or {}).get("eval_id")
    if eval_id is None and "checkpoints" not in meta:
        try:
            eval_id = f.config().checkpoint_eval_id()
        except Exception:  # noqa: BLE001 - a config that no longer validates: no curve
            eval_id = None
    return {s: scores_of(res) for s, res in f.step_evaluations(eval_id).items()} if eval_id else {}


def read(f: CellFolder, meta: dict) -> Record:
    results = f.results(meta.get("eval_id"))
    train, selection = f.summary(), f.selection()
    if "step" in selection:
        train["final_step"] = selection["step"]
    return Record(dir=f.path, slug=meta.get("slug", f.path.name), id=meta.get("id", ""), eval_id=meta.get("eval_id"),
                  varying=meta.get("varying", {}), config=flatten(f.raw_config()), state=_state(f, meta),
                  scores=scores_of(results), train=train, results=results, env=f.env(), curve=_curve(f, meta),
                  tune=meta.get("tune") or {})


def at_step(records: list[Record], step: int | str) -> list[Record]:
    """The records with the scores of one checkpoint instead of the final evaluation: step N, or "best" (the one
    train.select made final/; the last step for a cell without a selection)."""
    out = []
    for r in records:
        n = step if isinstance(step, int) else r.train.get("final_step", r.config.get("train.steps"))
        scores = r.curve.get(n, {}) if isinstance(n, int) else {}
        out.append(replace(r, scores=scores, train={**r.train, "scored_step": n}))
    return out


def collect(matrix_dir: Path, step: int | str | None = None, every: bool = False) -> list[Record]:
    """The cells of a matrix's run folder; `step`: with a checkpoint's scores (at_step); `every`: with the cell
    folders the matrix as last run does not list (left_out), the keys that tell them all apart as varying."""
    records = [read(f, meta) for f, meta in _entries(MatrixFolder(matrix_dir))]
    if every:
        records += [read(f, {**f.meta(), "eval_id": None}) for f in left_out(matrix_dir)]
        records = _apart(records)
    return records if step is None else at_step(records, step)


def left_out(matrix_dir: Path) -> list[CellFolder]:
    """Cell folders of the run folder that the matrix as last run (cells.json) does not list, a search's trials
    aside: earlier runs with other settings (`--set`), or cells the file no longer has."""
    from tunelab.report.status import search_trials

    m = MatrixFolder(matrix_dir)
    index = m.index()
    if index is None:
        return []
    listed = {str(e.get("id")) for e in index if isinstance(e, dict)} | set(search_trials(m))
    return [f for f in m.cells() if str(f.meta().get("id")) not in listed]


def left_out_notes(matrix_dir: Path) -> list[str]:
    """What the leaderboard says of the cells it does not show, in every format: the matrix's cells not started yet
    (their rows count only the runs that started, so a row of 1 run of 2 seeds says why), and folders the matrix as
    last run does not list (left_out)."""
    m = MatrixFolder(matrix_dir)
    unstarted = [str(e.get("slug")) for e in m.index() or [] if isinstance(e, dict) and m.find(e.get("id", "")) is None]
    more = " ..." if len(unstarted) > 12 else ""
    said = [f"Not started yet: {len(unstarted)} cell(s) of the matrix ({', '.join(unstarted[:12])}{more}): their "
            "rows count only the runs that started."] if unstarted else []
    found = left_out(matrix_dir)
    if not found:
        return said
    return said + [f"Not in this table: {len(found)} cell folder(s) that the matrix as last run does not list (earlier "
            f"runs with other settings, e.g. `--set`): {', '.join(f.path.name for f in found)}; `exp leaderboard "
            f"{matrix_dir} --all` shows every cell folder."]


def _apart(records: list[Record]) -> list[Record]:
    """Records of several runs: varying = the config keys whose values differ among them; a slug two of them share
    becomes their folders' names."""
    from collections import Counter

    keys = sorted({k for r in records for k in r.config if not k.startswith("tracking.")})
    differ = [k for k in keys if len({repr(r.config.get(k)) for r in records}) > 1]
    slugs = Counter(r.slug for r in records)
    return [replace(r, varying={k: r.config.get(k) for k in differ}, slug=r.slug if slugs[r.slug] == 1
                    else r.dir.name) for r in records]
