"""A leaderboard row's word on its search (tunelab.tune, as cells.json tells it): the tuned configuration of each
study, the budget spent, the spread of the trials' objective, a winner at the edge of its space, what it cost, the
median over several studies, and each method's performance profile over the workloads."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import Any

from tunelab.report.records import Record

KEYS = ("tuning", "tuned", "studies", "search trials", "search steps", "search cost", "search best",
        "search median", "search worst", "search edge", "profile score")
STUDIES_NOTE = ("A tuned row of several studies (tune.studies; `studies`): each score is the median over the "
                "studies of each study's winner (the mean over its seeds), [min, max] over the studies; `tuned` "
                "lists each study's winning values.")
EDGE_NOTE = ("`search edge`: a study's best value of a searched key lies at the edge of its range (the outer tenth "
             "of a continuous range, in log space for log_uniform; the first or last value of an int range or of a "
             "choice of numbers): the optimum may lie outside, widen the space (docs/tuning.md).")


def _studies(group: list[Record]) -> dict[int, dict]:
    """A tuned row's studies: study index -> its search summary (cells.json)."""
    return {int(r.tune.get("study_index") or 0): r.tune for r in sorted(group, key=lambda r: r.tune.get(
        "study_index") or 0)}


def _params(params: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def _edges(studies: dict[int, dict]) -> str | None:
    """'upper edge of optim.lr in 3 of 3 studies: widen the space'."""
    seen: Counter = Counter((e["side"], e["key"]) for t in studies.values() for e in t.get("edges") or [])
    if not seen:
        return None
    of = f" in {{n}} of {len(studies)} studies" if len(studies) > 1 else ""
    return "; ".join(f"{side} edge of {key}{of.format(n=n)}" for (side, key), n in seen.items()) + \
        ": widen the space"


def values(group: list[Record], costs: Any = None) -> dict:
    """A row's search columns: the tuned configuration (each study's), the budget it spent and the spread of its
    trials' objective (best, median, worst of those that trained the full budget), where a winner sits at an edge
    of its space, and what it cost (`costs`: report.cost.Folders); `default` for a group's cell as written."""
    t = group[0].tune
    if t.get("role") == "default":
        return {"tuning": "default"}
    if t.get("role") != "tuned":
        return {}
    studies = _studies(group)
    trials, pruned = (sum(x[k] for x in studies.values()) for k in ("trials", "pruned"))
    spent, full = (sum(x[k] for x in studies.values()) for k in ("search_steps", "full_steps"))
    values = sorted(v for x in studies.values() for v in (x.get("values") or []))
    many = len(studies) > 1 or (t.get("studies") or 1) > 1
    out = {"tuning": f"tuned ({t['sampler']}, {t['pruner']})",
           "tuned": " / ".join(_params(x["tuned"]) for x in studies.values() if x.get("tuned")),
           "search trials": f"{trials} ({pruned} pruned)" + (f" in {len(studies)} studies" if many else ""),
           "search steps": f"{spent} of {full}", "search edge": _edges(studies)}
    if many:
        ordered = values if t.get("direction", "minimize") == "minimize" else values[::-1]
        out |= {"studies": f"{len(studies)} of {t.get('studies')}" if len(studies) < (t.get("studies") or 1)
                else str(len(studies)), "search best": ordered[0] if ordered else None,
           "search median": statistics.median(values) if values else None,
                "search worst": ordered[-1] if ordered else None}
    else:
        out |= {f"search {k}": t[k] for k in ("best", "median", "worst")}
    if costs is not None:
        from tunelab.report.cost import of_row

        cost = of_row([r.tune for r in group], [r.dir for r in group], costs)
        out["search cost"] = cost.text() if cost.runs else None
    return out


def median_of_studies(stats: list[tuple[int, float]]) -> dict[str, Any] | None:
    """(study, value) of a tuned row's runs -> the fields of its Stat: the median over the studies of each study's
    mean, [min, max]; None when the row has a single study (its runs fold as seeds do)."""
    by: dict[int, list[float]] = {}
    for study, v in stats:
        by.setdefault(study, []).append(v)
    if len(by) < 2:
        return None
    means = [statistics.fmean(vs) for vs in by.values()]
    return {"mean": statistics.median(means), "spread": None, "n": len(stats), "studies": len(by),
            "low": min(means), "high": max(means)}


def keys(records: list[Record]) -> list[str]:
    """The search columns a board needs: studies, edges and the workload profile only where there are some."""
    tuned = [r.tune for r in records if r.tune.get("role") == "tuned"]
    wanted = {"studies": any((t.get("studies") or 1) > 1 for t in tuned),
              "search edge": any(t.get("edges") for t in tuned),
              "profile score": any(r.tune.get("workloads") for r in records if r.tune.get("role"))}
    return [k for k in KEYS if wanted.get(k, True)]


def notes(tuned: list[Record]) -> list[str]:
    """What the board says under its table of its tuned rows' studies and edges."""
    return ([STUDIES_NOTE] if any((r.tune.get("studies") or 1) > 1 for r in tuned) else []) + \
        ([EDGE_NOTE] if any(r.tune.get("edges") for r in tuned) else [])


def profiles_of(columns: list[Any], rows: list[dict], groups: list[list[Record]]) -> tuple[list[dict], str]:
    """Each method (a tuned group, or a group as written) over the workloads (tune.workloads): its Dolan-More
    profile on the search's objective and AlgoPerf's score (report/profiles.py), and the note that says so; each
    of its rows (`rows`, the board's, one per group of `groups`) gets the score."""
    from tunelab.report.profiles import TAU_MAX, TAUS, profiles

    results: dict[str, dict[str, float | None]] = {}
    rows_of: dict[str, list[dict]] = {}
    higher: bool | None = None
    metric = None
    for g, row in zip(groups, rows):
        t = g[0].tune
        if t.get("role") not in ("tuned", "default") or not t.get("workloads"):
            continue
        metric = t.get("metric")
        col = next((c for c in columns if c.kind == "score" and c.source == metric and not c.field), None)
        if col is None:
            continue
        higher = col.higher_is_better
        method = "-".join(str(v) for v in (t.get("method") or {}).values()) or t.get("group", "?")
        method += "-tuned" if t["role"] == "tuned" else " (default)"
        workload = "/".join(str(v) for v in (t.get("workload") or {}).values())
        results.setdefault(method, {})[workload] = row[col.name].mean
        rows_of.setdefault(method, []).append(row)
    if not results:
        return [], ""
    out: list[dict[str, Any]] = []
    for p in profiles(results, bool(higher)):
        out.append({"method": p.method, "workloads": p.workloads, "score": p.score(),
                    **{f"rho({tau:g})": p.rho(tau) for tau in TAUS},
                    "ratios": {w: (None if math.isinf(r) else r) for w, r in p.ratios.items()}})
        for row in rows_of[p.method]:
            row["profile score"] = f"{p.score():.3f} over {p.workloads} workloads"
    n = max(int(x["workloads"]) for x in out)
    return out, (f"`profile score`: each method's performance profile over the {n} workloads of the search (Dolan & "
                 f"More 2002) on {metric}: the share of workloads where its score is within a factor tau of the best "
                 f"method's, integrated from tau 1 to {TAU_MAX:g} over {TAU_MAX - 1:g} (AlgoPerf's benchmark score: "
                 f"1 = best on every workload, 0 = never within {TAU_MAX:g}x); it rests on {n} workloads.")
