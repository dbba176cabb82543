"""lm-eval's output for one task or group as a results.json entry and samples.jsonl records.

A registered benchmark names its headline (metric, filter) and the values reported beside it; any other lm-eval
task or group gets the first metric lm-eval reports for it as the headline and every other one in `also`.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunelab.evals.lmeval import lmdata

if TYPE_CHECKING:
    from tunelab.core.config import EvalCfg
    from tunelab.core.registries import Harness


@dataclass
class Setup:
    """What one run of an lm-eval task needs, decided before any data is loaded."""

    name: str
    h: Harness
    chosen: dict[str, str]  # leaves the subset was chosen from (all of them without one)
    root: Path | None = None  # the local data folder
    source: str = ""  # data_source; "" = read from the tasks' configs after the run
    loaded: Any = None  # the Task or Group built by lm-eval (its data loaded)
    tm: Any = None  # lm-eval's TaskManager: tunelab's tasks, the folders above, include_path, the scratch folder
    local: str | None = None  # the include_path folder of a task of the user's own


def num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not math.isnan(x) else None


def item_stderr(value: float | None, items: list) -> float | None:
    """The standard error of a mean over items (sample stdev / sqrt(n), lm-eval's formula for one task), used
    when lm-eval gives a group none: its group stderr pools the subtasks' and is undefined as soon as one
    subtask has a single item (MMLU at one question per subject). Only when the group's value is that item
    mean (a size-weighted group, as MMLU's and BBH's are), so it is never a stderr of some other number."""
    xs = [float(x) for x in items if isinstance(x, (int, float, bool))]
    if value is None or len(xs) < 2 or abs(statistics.fmean(xs) - value) > 1e-9:
        return None
    return statistics.stdev(xs) / math.sqrt(len(xs))


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def metrics(head: dict) -> list[tuple[str, str]]:
    """The (metric, filter) pairs lm-eval reports in one results entry, in its order."""
    return [tuple(k.split(",", 1)) for k in head if "," in k and "_stderr," not in k]


def _also(setup: Setup, head: dict, metric: str, filt: str) -> dict[str, float | None]:
    if setup.h.metric:
        return {(a[2] if len(a) > 2 else f"{a[0]} ({a[1]})"): num(head.get(f"{a[0]},{a[1]}")) for a in setup.h.also}
    return {f"{m} ({f})": num(head.get(f"{m},{f}")) for m, f in metrics(head) if (m, f) != (metric, filt)}


def _alias(setup: Setup, leaf: str) -> str:
    return leaf.removeprefix(setup.h.lm_task + "_") if setup.h.leaf_tags else leaf


def _average(setup: Setup, metric: str) -> str:
    """micro (a mean over items) or macro (a mean of the subtasks' values), as lm-eval's group aggregates."""
    if setup.h.metric:
        from tunelab.core.registries import TASKS

        return TASKS[setup.name].average if setup.name in TASKS else "micro"
    group = setup.tm.task_index[setup.h.lm_task].cfg or {}
    aggs = group.get("aggregate_metric_list") or []
    agg = next((a for a in aggs if a.get("metric") == metric), aggs[0] if aggs else None)
    return "micro" if agg is None or agg.get("weight_by_size") else "macro"


def records(setup: Setup, out: dict, metric: str, filt: str) -> list[dict]:
    """One samples.jsonl record per scored item of the headline's filter; `item_metric` names its score's key."""
    rows = []
    for leaf in sorted(out["samples"]):
        for s in sorted(out["samples"][leaf], key=lambda s: s["doc_id"]):
            if s["filter"] != filt:
                continue
            raw = s["resps"][0][0] if s["resps"] and s["resps"][0] else None
            rows.append({"task": setup.name, "subtask": _alias(setup, leaf), "doc_id": s["doc_id"],
                         "doc_hash": s["doc_hash"], "prompt_hash": s["prompt_hash"], "target": s["target"],
                         "response": s["filtered_resps"], metric: s.get(metric), "item_metric": metric,
                         **({"raw": raw} if isinstance(raw, str) else {})})
    return rows


def _leaves(setup: Setup, out: dict, metric: str, filt: str) -> dict[str, dict]:
    res = out["results"]
    return {_alias(setup, leaf): {"value": num(res[leaf].get(f"{metric},{filt}")),
                                  "stderr": num(res[leaf].get(f"{metric}_stderr,{filt}")),
                                  "n": out["n-samples"][leaf]["effective"], "shots": out["n-shot"].get(leaf)}
            for leaf in sorted(out["configs"])}


def collect(setup: Setup, out: dict, base: dict, cfg: EvalCfg, samples_path: Path | None) -> dict:
    """The results.json entry of one task (status ok); appends its items to samples_path."""
    import lm_eval

    head = out["results"][setup.h.lm_task]
    metric, filt = (setup.h.metric, setup.h.filter) if setup.h.metric else (metrics(head) or [("", "")])[0]
    per_leaf = _leaves(setup, out, metric, filt)
    rows = records(setup, out, metric, filt)
    if samples_path is not None:
        with samples_path.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(r, default=str) + "\n" for r in rows)
    values = [v["value"] for v in per_leaf.values() if v["value"] is not None]
    shots = sorted({v["shots"] for v in per_leaf.values() if v["shots"] is not None})
    value, stderr = num(head.get(f"{metric},{filt}")), num(head.get(f"{metric}_stderr,{filt}"))
    if stderr is None:
        stderr = item_stderr(value, [r[metric] for r in rows])
    cut = any(n["effective"] < n["original"] for n in out["n-samples"].values())
    grouped = bool(setup.h.leaf_tags) or setup.h.lm_task not in out["configs"]  # a group: per-member values
    return {
        **base, "metric": setup.h.label or (metric if filt == "none" else f"{metric} ({filt})"),
        "headline": setup.h.headline or f"lm-eval's {metric} ({filt}) of {setup.h.lm_task}",
        "lm_eval_metric": f"{metric},{filt}", "status": "ok", "value": value, "stderr": stderr,
        "n": sum(v["n"] for v in per_leaf.values()),
        "shots": shots[0] if len(shots) == 1 else shots, "limit": cfg.limit_for(setup.name),
        # a limit that cut nothing (limit 8 over 8 items) scored the whole test set: no subset
        "subset": bool(cfg.subtasks.get(setup.name)) or cut,
        "macro": statistics.fmean(values) if values else None, "average": _average(setup, metric),
        "higher_is_better": (out.get("higher_is_better") or {}).get(setup.h.lm_task, {}).get(metric, True),
        "also": _also(setup, head, metric, filt), "subtasks": per_leaf if grouped else {},
        "data_source": setup.source or lmdata.described(out["configs"]),
        "notes": setup.h.notes.load()(setup.root, list(setup.chosen.values())) if setup.h.notes else "",
        "task_version": out["versions"].get(setup.h.lm_task),
        "prompt_hash": sha("".join(r["prompt_hash"] for r in rows)),
        "task_config_hash": sha(json.dumps({n: out["configs"][n] for n in sorted(out["configs"])}, sort_keys=True,
                                           default=str)),
        "chat_template": cfg.chat_template,
        "lm_eval_version": lm_eval.__version__ if hasattr(lm_eval, "__version__") else None,
    }
