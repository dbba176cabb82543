"""Where every number of the report comes from, as rows of display strings: each score with the task version,
prompt hash, shots, data source, harness and n it was measured with, and each cell's software and hardware.

The rows come from the records (report/records.py): results.json of the evaluation the matrix asks for, and
env.json of the cell. A score that is a subset, a stand-in or unavailable says so in its own row.
"""

from __future__ import annotations

from collections import Counter

from tunelab.core.registries import TASKS
from tunelab.report.records import Record
from tunelab.report.scores import Score, fmt, marked


def marks(s: Score) -> str:
    """The marks of report/scores.py in words, for the row of one score."""
    out = []
    if s.status != "ok" or s.value is None:
        out.append(f"unavailable: {s.reason}" if s.reason else "unavailable")
    if s.subset:
        official = TASKS[s.task].official_n if s.task in TASKS else None
        items = f"{s.n} of {official} items" if official else f"{s.n} item{'' if s.n == 1 else 's'}"
        out.append(f"* subset: {items}")
    if s.stand_in:
        out.append("stand-in: exercises the pipeline, not the benchmark")
    return "; ".join(out)


def _harness(res: dict, versions: dict) -> str:
    """lm-eval for the tasks it runs (version as the task recorded it, and which code served the requests: the
    engine, or lm-eval's hf code and why); tunelab's own code otherwise (val_loss, HumanEval's generator and
    sandbox)."""
    if "lm_eval_task" in res:
        served = sorted({path for paths in (res.get("served") or {}).values() for path in paths})
        how = f" ({', '.join('tunelab engine' if p == 'engine' else p for p in served)})" if served else ""
        return f"lm-eval {res.get('lm_eval_version') or versions.get('lm_eval') or '?'}{how}"
    return f"tunelab {versions.get('tunelab') or '?'}"


def _shots(v) -> str:
    return ", ".join(map(str, v)) if isinstance(v, list) else fmt(v)


def score_rows(records: list[Record]) -> list[dict]:
    """One row per cell and task; a cell without scores gets one row saying why."""
    rows = []
    for r in records:
        versions = r.results.get("versions") or {}
        tasks = r.results.get("tasks") or {}
        if not r.scores:
            rows.append({"cell": r.slug, "state": r.state, "task": "-", "value": "-", "marks":
                         "no results.json yet" if not r.results else "no scores in results.json"})
            continue
        for task, s in r.scores.items():
            res = tasks.get(task, {})
            rows.append({
                "cell": r.slug, "state": r.state, "task": task, "metric": s.metric,
                "value": marked(s.value, s.subset, not s.ok, bool(r.tune.get("test_selected"))), "±": fmt(s.stderr),
                "n": str(s.n),
                "marks": marks(s), "shots": _shots(res.get("shots")), "task version": fmt(res.get("task_version")),
                "prompt hash": res.get("prompt_hash") or "-", "harness": _harness(res, versions),
                "data source": res.get("data_source") or "-", "eval id": r.eval_id or "-",
            })
    return rows


def device(env: dict) -> str:
    gpus = env.get("cuda_devices") or []
    if gpus:
        return ", ".join(f"{n} x {name}" for name, n in Counter(gpus).items())
    return f"CPU ({env['cpu_count']} cores)" if env.get("cpu_count") else "-"


def cell_rows(records: list[Record]) -> list[dict]:
    """Each cell's state, where it ran and with what (env.json), and its error when it failed."""
    rows = []
    for r in records:
        pkgs = r.env.get("packages") or {}
        error = r.folder.status().get("error") or ""
        rows.append({"cell": r.slug, "id": r.id, "state": r.state, "folder": r.dir.name,
                     "torch": pkgs.get("torch") or "-", "transformers": pkgs.get("transformers") or "-",
                     "device": device(r.env), "python": r.env.get("python") or "-",
                     "git commit": (r.env.get("git_commit") or "-")[:10],
                     "error": error if len(error) <= 300 else error[:300] + "..."})
    return rows


def version_rows(records: list[Record]) -> list[dict]:
    """The `versions` block of each cell's results.json (what the scores were computed with)."""
    return [{"cell": r.slug, **{k: fmt(v) for k, v in (r.results.get("versions") or {}).items()}}
            for r in records if r.results]
