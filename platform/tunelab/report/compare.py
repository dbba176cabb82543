"""`exp compare A B`: two cells (or two matrices, cell by cell on their common keys) side by side.

For each cell pair: the config keys that differ; for every task both evaluated, the score difference with a
paired significance test over the per-item results of eval/<eval-id>/samples.jsonl (report/stats.py), refused
with the reason when the two sides did not score the same items; and the training figures (loss, memory,
speed) with their differences.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tunelab.core.errors import UserError
from tunelab.core.files import read_jsonl
from tunelab.core.registries import TASKS
from tunelab.folders.cell import CellFolder
from tunelab.folders.matrix import MatrixFolder
from tunelab.report.ranking import Ranking, of_rows
from tunelab.report.records import TRAIN_FIGURES, Record, collect, read
from tunelab.report.stats import RATIOS, Paired, paired

ITEM_SCORE_FIELDS = ("acc", "exact_match", "passed")  # the per-item score in samples.jsonl, by task kind


@dataclass
class TaskComparison:
    task: str
    result: Paired | None = None
    refused: str = ""  # why no test was run
    values: tuple = (None, None)  # the two headline values from results.json
    scores: tuple = (None, None)  # the two Scores (their marks: a subset, unavailable), None where not scored


@dataclass
class Comparison:
    a: Record
    b: Record
    config_diff: dict[str, tuple]  # key -> (A value, B value)
    tasks: list[TaskComparison] = field(default_factory=list)
    figures: dict[str, tuple] = field(default_factory=dict)  # column -> (A, B)


def _score(value):
    """An item's score: a number (a bool is 0/1), or the (log-likelihood, words or bytes) pair of a perplexity
    item, whose task's headline is a ratio of sums (stats.RATIOS); None when it is neither."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(x, (int, float)) for x in value):
        return (float(value[0]), float(value[1]))
    return None


def items(rec: Record) -> dict[str, dict[tuple, tuple[str, float]]]:
    """{task: {item key: (subtask, score)}}; HumanEval's score is the pass rate of a problem's samples. An lm-eval
    record names its score's key (`item_metric`); older records hold acc or exact_match."""
    path = rec.folder.samples_file(rec.eval_id)
    out: dict[str, dict] = defaultdict(dict)
    passes: dict[tuple, list[float]] = defaultdict(list)
    for r in read_jsonl(path) if path else []:
        field_ = r.get("item_metric") or next((f for f in ITEM_SCORE_FIELDS if f in r), None)
        if field_ is None or (score := _score(r.get(field_))) is None:
            continue
        if r["task"] == "humaneval":
            passes[(r["task"], r["task_id"])].append(score)
            continue
        key = (r.get("subtask"), r.get("doc_id"), r.get("doc_hash"))
        out[r["task"]][key] = (str(r.get("subtask")), score)
    for (task, tid), ps in passes.items():
        out[task][(tid,)] = ("", sum(ps) / len(ps))
    return out


def _task(task: str, a: dict, b: dict, resamples: int, seed: int, average: str = "micro") -> TaskComparison:
    if set(a) != set(b):
        return TaskComparison(task, refused=f"the two sides scored different items ({len(a)} and {len(b)}, "
                              f"{len(set(a) & set(b))} in common): a paired test needs the same items; "
                              "evaluate both with the same eval settings")
    keys = sorted(a, key=repr)
    groups = np.array([a[k][0] for k in keys])
    average = TASKS[task].average if task in TASKS else average
    sa, sb = (np.array([side[k][1] for k in keys]) for side in (a, b))
    return TaskComparison(task, paired(sa, sb, groups, average, resamples, seed))


def compare_cells(a: Record, b: Record, resamples: int = 10_000, seed: int = 0) -> Comparison:
    keys = sorted(set(a.config) | set(b.config))
    diff = {k: (a.config.get(k), b.config.get(k)) for k in keys
            if a.config.get(k) != b.config.get(k) and not k.startswith("tracking.")}
    out = Comparison(a, b, diff)
    ia, ib = items(a), items(b)
    for task in dict.fromkeys([*a.scores, *b.scores]):
        scores = (a.scores.get(task), b.scores.get(task))
        values = tuple(s.value if s else None for s in scores)
        missing = [side for side, s in zip("AB", scores) if s is not None and not s.ok]
        if missing:
            reason = next(s.reason for s in scores if s and not s.ok) or "no score"
            why = f"unavailable on {' and '.join(missing)} ({reason})"
            out.tasks.append(TaskComparison(task, refused=why, values=values, scores=scores))
        elif task not in ia or task not in ib:
            why = "no per-item results" if task == "val_loss" else "scored on one side only, or no samples"
            out.tasks.append(TaskComparison(task, refused=why, values=values, scores=scores))
        else:
            res = (a.results.get("tasks") or {}).get(task, {})
            # how the task's headline is made from its items: lm-eval's groups say (micro or macro), a perplexity
            # is a ratio of sums (stats.RATIOS)
            average = res.get("metric") if res.get("metric") in RATIOS else res.get("average") or "micro"
            out.tasks.append(_task(task, ia[task], ib[task], resamples, seed, average))
            out.tasks[-1].values, out.tasks[-1].scores = values, scores
    for key, (header, _) in TRAIN_FIGURES.items():
        out.figures[header] = (a.train.get(key), b.train.get(key))
    out.figures["val_loss"] = (a.train.get("val_loss"), b.train.get("val_loss"))
    return out


def state_of(rec: Record) -> str:
    """What `exp compare` says of a side beside its folder: its state, and an evaluation that did not finish."""
    partial = rec.results and rec.results.get("complete") is False
    return rec.state + (", its evaluation not complete: the scores are of the tasks it finished" if partial else "")


def _record(path: Path) -> Record:
    folder = CellFolder(path)
    if not folder.meta_file.is_file():
        raise UserError("not a cell folder (no cell.json): give a cell folder runs/<matrix>/<cell>/ or a matrix's "
                        "run folder runs/<matrix>/", file=path)
    return read(folder, {**folder.meta(), "eval_id": None})


def _row_of(path: Path) -> list[Record] | None:
    """runs/<matrix>/<label>: the cells of a leaderboard row (a tuned group's winner, each seed), by the row's label
    (the slug without its seed); None when the path names no row."""
    if path.exists() or not MatrixFolder(path.parent).index_file.is_file():
        return None
    records = collect(path.parent)
    return [r for r in records if path.name in (r.slug, r.slug.removesuffix(f"-s{r.config.get('train.seed')}"))
            or (r.tune.get("role") == "tuned" and path.name == f"{r.tune.get('group')}-tuned")]


def _rows(a: Path, b: Path) -> list[tuple[Record, Record]] | None:
    """Two leaderboard rows (e.g. two tuned groups: runs/M/adamw-tuned runs/M/lion-tuned), paired seed by seed."""
    ra, rb = _row_of(a), _row_of(b)
    if ra is None or rb is None:
        return None
    for path, rows in ((a, ra), (b, rb)):
        if not rows:
            index = MatrixFolder(path.parent).index_file
            raise UserError(f"no cell folder, and no row of {index} is labelled {path.name!r}", file=path)
    by_seed = {_study_seed(r): r for r in rb}
    matched = [(x, by_seed[s]) for x in ra if (s := _study_seed(x)) in by_seed]
    if not matched:
        raise UserError(f"{a.name} and {b.name} share no seed: a paired comparison needs the same seeds")
    return matched


def _study_seed(r: Record) -> tuple[int, int]:
    """A tuned row's run: its study (tune.studies) and its seed."""
    return int(r.tune.get("study_index") or 0), int(r.config.get("train.seed") or 0)


def rankings(a: Path, b: Path, resamples: int = 10_000, seed: int = 0) -> list[Ranking]:
    """Two tuned rows: per task both scored, how often A ranks above B when studies and seeds are drawn again
    (report/ranking.py); [] unless both are tuned rows."""
    ra, rb = _row_of(a), _row_of(b)
    if not ra or not rb or not all(r.tune.get("role") == "tuned" for r in (*ra, *rb)):
        return []
    out = []
    for task in dict.fromkeys(t for r in ra for t in r.scores):
        found = of_rows(task, ra, rb, resamples, seed)
        if found is not None:
            out.append(found)
    return out


def pairs(a: Path, b: Path) -> list[tuple[Record, Record]]:
    """Two cells, two leaderboard rows (seed by seed), or the cells of two matrices matched on the keys both vary
    (refused when that is ambiguous)."""
    rows = _rows(a, b)
    if rows is not None:
        return rows
    for p in (a, b):
        if not p.is_dir():
            raise UserError("no such folder", file=p)
    cells = [CellFolder(p).meta_file.is_file() for p in (a, b)]
    if all(cells):
        return [(_record(a), _record(b))]
    if any(cells):
        raise UserError(f"compare two cells or two matrices, not one of each ({a} and {b})")
    ra, rb = collect(a), collect(b)
    if not ra or not rb:
        raise UserError(f"no cells in {a if not ra else b}")
    common = sorted(set().union(*(r.varying for r in ra)) & set().union(*(r.varying for r in rb)))

    def index(records: list[Record], where: Path) -> dict[tuple, Record]:
        out: dict[tuple, Record] = {}
        for r in records:
            key = tuple(repr(r.config.get(k)) for k in common)
            if key in out:
                raise UserError(f"{where}: cells {out[key].slug} and {r.slug} have the same values of the keys both "
                                f"matrices vary ({', '.join(common) or 'none'}); compare those cells one by one")
            out[key] = r
        return out

    xa, xb = index(ra, a), index(rb, b)
    matched = [(xa[k], xb[k]) for k in xa if k in xb]
    if not matched:
        raise UserError(f"no cell of {a} matches a cell of {b} on the keys both vary ({', '.join(common)})")
    return matched
