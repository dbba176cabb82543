"""The leaderboard as data: one row per cell configuration, seeds folded into mean ± std with n.

Rows group the cells by the keys that tell them apart (`by`, default: the varying keys but `train.seed`); a key
is shown only where it applies (peft.r on a LoRA cell, not on a full-parameter one: tunelab.core.registries.PEFT
says which peft keys a method reads) and only when it varies among the cells where it applies. A single run
shows its score's standard error from results.json as the spread; folded seeds show the standard deviation
over runs.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tunelab.core.errors import UserError, did_you_mean
from tunelab.core.registries import PEFT
from tunelab.folders.targets import row_label
from tunelab.report import tuned_rows
from tunelab.report.records import TRAIN_FIGURES, Record
from tunelab.report.scores import TEST_SELECTED_NOTE

SEED = "train.seed"


@dataclass(frozen=True)
class Stat:
    mean: float | None
    spread: float | None  # stderr of one run, or std over runs
    n: int  # runs behind the value
    subset: bool = False
    unavailable: bool = False
    stand_in: bool = False
    best: bool = False
    test_selected: bool = False  # its configuration was chosen on a test set's score (tune.allow_test_selection)
    studies: int = 0  # > 1: a tuned row's value is the median over its studies' winners (tune.studies) ...
    low: float | None = None  # ... and these the smallest and largest of them
    high: float | None = None
    items: int | None = None  # a score's items, the same in each of its runs (None: they differ, or a figure)


@dataclass(frozen=True)
class Column:
    name: str
    kind: str  # score | figure
    higher_is_better: bool | None = None
    source: str = ""  # the task of a score column, the train/summary.json key of a figure
    field: str = ""  # a score column of one of the task's other values (Score.columns), not its headline


@dataclass
class Board:
    keys: list[str]
    columns: list[Column]  # score and figure columns, in order
    rows: list[dict] = field(default_factory=list)  # cell, status, runs, key values, column name -> Stat
    aggregated: bool = False
    notes: list[str] = field(default_factory=list)  # said under the table in every format
    profiles: list[dict] = field(default_factory=list)  # each method over the workloads (tune.workloads)

    @property
    def spread_kind(self) -> str:
        """What ± means in this board: "std" over the runs of a row, or the "stderr" of a single run's score."""
        return "std" if any(r["runs"] > 1 for r in self.rows) else "stderr"


def applies(key: str, config: dict) -> bool:
    """Whether a config key means anything for this cell (a peft setting its method does not read does not)."""
    if key.startswith("peft.") and key != "peft.method":
        return key.removeprefix("peft.") in PEFT[config.get("peft.method", "none")].keys
    return True


def value_of(rec: Record, key: str):
    return rec.config.get(key) if applies(key, rec.config) else None


def shown_keys(records: list[Record], exclude: tuple[str, ...] = ()) -> list[str]:
    """Varying keys that take more than one value among the cells where they apply."""
    # eval.checkpoints changes no number of the board (it adds scores along training, not a column): not shown
    keys = list(dict.fromkeys(k for r in records for k in r.varying if k not in exclude
                              and not k.startswith("eval.checkpoints")))
    return [k for k in keys if len({repr(value_of(r, k)) for r in records if applies(k, r.config)}) > 1]


def _stat(values: list[float], stderrs: list, subset: bool, unavailable: bool, stand_in: bool) -> Stat:
    if not values:
        return Stat(None, None, 0, subset, unavailable, stand_in)
    if len(values) == 1:
        return Stat(values[0], stderrs[0] if stderrs else None, 1, subset, False, stand_in)
    return Stat(statistics.fmean(values), statistics.stdev(values), len(values), subset, False, stand_in)


def _row(group: list[Record], keys: list[str], columns: list[Column], label: str, costs: Any = None) -> dict:
    done = [r for r in group if r.state == "done"]
    states = Counter(r.state for r in group)
    searched = tuned_rows.values(group, costs)
    several = len({r.tune.get("study_index") for r in group if r.tune.get("role") == "tuned"}) > 1
    varied = set(group[0].tune.get("tuned") or {}) if several else set()  # each study's own: in `tuned`
    row = {"cell": label, "status": next(iter(states)) if len(states) == 1 else
           ", ".join(f"{n} {s}" for s, n in states.items()), "runs": len(done),
           **{k: None if k in varied else value_of(group[0], k) for k in keys}}
    row.update({k: searched.get(k) for k in keys if k in tuned_rows.KEYS})
    row["tags"] = tags(group)
    on_test = bool(group[0].tune.get("test_selected"))
    for col in columns:
        if col.kind == "score":
            pairs = [(r, s) for r in done if (s := r.scores.get(col.source)) is not None]
            scores = [s for _, s in pairs]
            ok = [(r, s) for r, s in pairs if s.ok]
            values = [(r, float(v)) for r, s in ok
                      if (v := s.value if not col.field else dict(s.columns).get(col.field)) is not None]
            studied = tuned_rows.median_of_studies([(int(r.tune.get("study_index") or 0), v) for r, v in values]) \
                if several else None
            flags = (any(s.subset for s in scores), bool(scores) and not ok, any(s.stand_in for s in scores))
            row[col.name] = (Stat(**studied, subset=flags[0], stand_in=flags[2]) if studied
                             else _stat([v for _, v in values], [s.stderr for _, s in ok] if not col.field else [],
                                        *flags))
            counts = {s.n for _, s in ok}
            row[col.name] = Stat(**{**row[col.name].__dict__, "test_selected": on_test,
                                    "items": counts.pop() if len(counts) == 1 else None})
        else:
            vals = [float(r.train[col.source]) for r in done if isinstance(r.train.get(col.source), (int, float))]
            row[col.name] = _stat(vals, [], False, False, False)
    return row


def _columns(records: list[Record]) -> list[Column]:
    scores: dict[str, Any] = {}
    for r in records:
        for s in r.scores.values():
            scores.setdefault(s.header, Column(s.header, "score", s.higher_is_better, s.task))
            for label, _ in s.columns:
                name = f"{s.task} {label}"
                scores.setdefault(name, Column(name, "score", s.higher_is_better, s.task, label))
    figures = [Column(h, "figure", hib, k) for k, (h, hib) in TRAIN_FIGURES.items()
               if any(k in r.train for r in records)]
    return list(scores.values()) + figures


def _label(group: list[Record], by: list[str] | None, aggregate: bool) -> str:
    if by:
        return ", ".join(f"{k}={value_of(group[0], k)}" for k in by)
    first = group[0]
    if not aggregate:
        return first.slug
    return row_label(first.slug, first.tune, first.config.get(SEED) if SEED in first.varying else None)


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _mark_best(board: Board) -> None:
    for col in board.columns:
        if col.higher_is_better is None:
            continue
        counts = {r[col.name].items for r in board.rows if _finite(r[col.name].mean)} if col.kind == "score" else set()
        if len(counts) > 1:  # a score over 2 items beside one over 164 is not like for like: no best between them
            said = ", ".join(sorted(str(c) for c in counts if c is not None)) + (", mixed" if None in counts else "")
            board.notes.append(f"{col.name}: its rows scored different numbers of items ({said}), so no value is "
                               "marked best.")
            continue
        means = [m for r in board.rows if _finite(m := r[col.name].mean)]  # (a diverged run's NaN is no best)
        if len(set(means)) < 2:  # one value, or all equal: nothing stands out
            continue
        best = max(means) if col.higher_is_better else min(means)
        for r in board.rows:
            if _finite(r[col.name].mean) and math.isclose(r[col.name].mean, best, rel_tol=1e-12, abs_tol=0):
                r[col.name] = Stat(**{**r[col.name].__dict__, "best": True})


def build(records: list[Record], *, aggregate: bool = True, by: list[str] | None = None,
          where: dict[str, str] | None = None, sort: str | None = None, notes: list[str] | None = None) -> Board:
    """The leaderboard of `records`: rows grouped by `by` (default: every varying key but the seed when
    `aggregate`, else one row per cell), filtered by `where` (key -> value as written in YAML), `notes` said
    under it. An unknown key, or a filter no cell matches, is a UserError naming it."""
    known = sorted({k for r in records for k in r.config})
    for option, keys in (("--where", list(where or {})), ("--by", by or [])):
        for key in keys:
            if records and key not in known:
                varying = sorted({k for r in records for k in r.varying})
                raise UserError(f"{option} {key!r}: no such config key{did_you_mean(key, known)}; keys are dotted "
                                f"config keys, like the ones this matrix varies: {', '.join(varying) or known[0]}")
    kept = [r for r in records if all(str(r.config.get(k)) == v for k, v in (where or {}).items())]
    if records and not kept:
        values = {k: sorted({str(r.config.get(k)) for r in records}) for k in where or {}}
        raise UserError("--where " + " ".join(f"{k}={v}" for k, v in (where or {}).items()) + " matches no cell; "
                        + "; ".join(f"{k} takes {', '.join(vs)}" for k, vs in values.items()))
    records = kept
    keys = by or shown_keys(records, exclude=(SEED,) if aggregate else ())
    tuned = [r for r in records if r.tune.get("role") == "tuned"]
    if any(r.tune.get("role") in ("tuned", "default") for r in records):
        keys = [*keys, *(k for k in tuned_rows.keys(records) if k not in keys)]
    columns = _columns(records)
    selected = [TEST_SELECTED_NOTE] if any(r.tune.get("test_selected") for r in records) else []
    notes = _model_notes(records) + _together_notes(records) + selected + list(notes or [])
    board = Board(keys, columns, aggregated=aggregate or bool(by), notes=notes + tuned_rows.notes(tuned))
    costs = None
    if tuned:
        from tunelab.report.cost import Folders

        costs = Folders(tuned[0].dir.parent)
    groups = grouped(records, aggregate, by)
    board.rows = [_row(g, keys, columns, label, costs) for label, g in groups]
    if board.spread_kind == "std":  # one statistic a column: a value of one run has no spread over runs, and its
        for row in board.rows:  # own standard error beside the others' standard deviations would read as one
            for c in columns:
                if isinstance(s := row.get(c.name), Stat) and s.n == 1 and s.spread is not None:
                    row[c.name] = Stat(**{**s.__dict__, "spread": None})
    if "profile score" in keys:
        board.profiles, note = tuned_rows.profiles_of(board.columns, board.rows, [g for _, g in groups])
        board.notes += [note] if note else []
    _mark_best(board)
    if sort:
        _sort(board, sort)
    return board


def grouped(records: list[Record], aggregate: bool = True,
            by: list[str] | None = None) -> list[tuple[str, list[Record]]]:
    """The leaderboard's rows as groups of records, with their labels: one per configuration (seeds folded; a
    tuned group's studies fold into its one row), per value of `by`, or per cell (aggregate False)."""
    group_keys = by or ([k for k in dict.fromkeys(k for r in records for k in r.varying) if k != SEED]
                        if aggregate else None)
    groups: dict[tuple, list[Record]] = {}
    for i, r in enumerate(records):
        if aggregate and not by and r.tune.get("role") == "tuned" and r.tune.get("group"):  # each study's own values
            gid: tuple = ("tuned", r.tune.get("group"))
        else:
            gid = tuple(repr(value_of(r, k)) for k in group_keys) if group_keys is not None else (i,)
        groups.setdefault(gid, []).append(r)
    return [(_label(g, by, aggregate), g) for g in groups.values()]


def tags(records: list[Record]) -> list[str]:
    """A row's share of the board's notes, as short words for the CSV and JSON (the other formats say the notes in
    full): its peak MB is a together-group's process, its weights a stand-in (_together_notes, _model_notes)."""
    return [tag for tag, of in (("peak-MB-of-together-group", _group_peak), ("model-weights-stand-in", _model_note))
            if any(of(r) for r in records)]


def _model_note(r: Record) -> str | None:
    """env.json's note on the weights (e.g. a dequantized stand-in)."""
    return (r.env.get("model") or {}).get("note")


def _group_peak(r: Record) -> bool:
    """Its peak MB is a together-group's process (train/summary.json `together`)."""
    return (r.train.get("together") or {}).get("members", 1) > 1 and "peak_mem_mb" in r.train


def _model_notes(records: list[Record]) -> list[str]:
    """Weights that are not what their name says (env.json's model note, e.g. a dequantized stand-in)."""
    by_note: dict[str, list[str]] = {}
    for r in records:
        if note := _model_note(r):
            by_note.setdefault(note, []).append(r.slug)
    return [f"Model weights of {', '.join(cells)}: {note}." for note, cells in by_note.items()]


def _together_notes(records: list[Record]) -> list[str]:
    """peak MB of a cell trained in a together-group is its group's process (train/summary.json `together`): not
    comparable with a cell trained alone."""
    joined = [r.slug for r in records if _group_peak(r)]
    if not joined:
        return []
    which = ", ".join(joined) if len(joined) <= 6 else f"{len(joined)} cells"
    return [f"peak MB of {which}: trained in a together-group, so the group's whole process (the base once, every "
            "member's adapter, optimizer state and activations), not comparable with a cell trained alone."]


def _sort(board: Board, column: str) -> None:
    """Best first for a score or figure column (a leading '-' reverses), by value for a key column."""
    reverse = column.startswith("-")
    name = column.lstrip("-")
    col = next((c for c in board.columns if c.name == name), None)
    if col is not None:
        def finite(r) -> bool:
            return _finite(r[name].mean)

        ordered = sorted(filter(finite, board.rows), key=lambda r: r[name].mean,
                         reverse=bool(col.higher_is_better) != reverse)
        board.rows = ordered + [r for r in board.rows if not finite(r)]  # a missing value or a NaN last, either way
    elif name in board.keys or name in ("cell", "status"):
        values = [r.get(name) for r in board.rows]
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)  # 5e-05 before 0.001
        if numeric:
            board.rows.sort(key=lambda r: float(r[name]), reverse=reverse)
        else:
            board.rows.sort(key=lambda r: str(r.get(name)), reverse=reverse)
    else:
        names = ["cell", "status", *board.keys, *(c.name for c in board.columns)]
        raise UserError(f"--sort {column!r}: no such column{did_you_mean(name, names)}; columns: {', '.join(names)}")
