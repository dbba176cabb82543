"""The lm-eval bridge: every task but val_loss and HumanEval is an lm-eval task or group, scored by
`lm_eval.simple_evaluate` against one `SharedPrefixLM` wrapping the cell's model in memory.

tunelab's benchmarks are lm-eval tasks defined in tasks/ (or lm-eval's own, `Harness.builtin`) with the facts of
their registry entry (tunelab.core.registries.TASKS: headline metric, data source, ...). Any other name is lm-eval's
task or group, or one of `eval.include_path`: its headline is the first metric lm-eval reports for it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from tunelab.core.config import EvalCfg
from tunelab.core.errors import UserError
from tunelab.core.paths import REPO_ROOT
from tunelab.core.registries import TASKS, Harness
from tunelab.evals.lmeval import lmdata, nltk_data
from tunelab.evals.lmeval.results import Setup, collect, item_stderr  # noqa: F401 - item_stderr: tests
from tunelab.evals.testsets import exemplars, sources
from tunelab.plan import lmtasks

TASKS_DIR = REPO_ROOT / "tasks"
BOOTSTRAP_ITERS = 1000  # only for metrics without a closed-form stderr; acc and exact_match have one


def harness_of(name: str) -> Harness:
    """A registered benchmark's facts, or those of any lm-eval task or group (the headline found in its results)."""
    spec = TASKS[name].harness if name in TASKS else None
    return spec or Harness(name, "", "", "", "", builtin=True)


def mmlu_notes(root: Path | None, leaves: list[str]) -> str:
    if root is None:
        return "5-shot from the hub's dev split"
    short = {s: n for s in leaves
             if not (root / "mmlu" / s / "dev.jsonl").is_file() and (n := len(sources.SHIPPED[("mmlu", "dev")](s))) < 5}
    few = "; fewer where fewer exist: " + ", ".join(f"{s} {n}-shot" for s, n in short.items()) if short else ""
    return ("5-shot; dev questions from the local dev.jsonl, else recovered from the Flan CoT prompts lm-eval "
            f"ships (mmlu/flan_cot_fewshot), which are the MMLU dev questions{few}")


SMOKE_GSM8K: dict[str, Any] = {"generator": "arithmetic", "n": 200, "seed": 1000, "held_out": True}  # = the YAML's


def smoke_gsm8k_items() -> list[str]:
    return [d["question"] for d in sources.generated_docs(**SMOKE_GSM8K)]


def smoke_bbh_items() -> list[str]:
    return [r["input"] for t in exemplars.bbh_tasks() for r in exemplars.bbh(t)]


def task_manager(roots: dict[str, str] | None = None, extra: list[Path] | tuple[Path, ...] = (),
                 builtin: list[Path] | tuple[Path, ...] = (), own: bool = True) -> Any:
    """tunelab's tasks/ (unless not `own`: lm-eval's tasks need none of them), after the folders of lm-eval's own
    tasks a run needs (`builtin`: indexing all of lm-eval's ~15k tasks takes many seconds) and before `extra`
    (include_path, then the scratch folder), which may redefine a task or group (a subset of a group's leaves, a
    task pointed at local files)."""
    from lm_eval.tasks import TaskManager

    paths = [str(p) for p in (*builtin, *([TASKS_DIR] if own else []), *extra)]
    return TaskManager(include_path=paths, include_defaults=False, metadata={"tunelab_roots": roots or {}})


def leaves(h: Harness, tm: Any) -> dict[str, str]:
    """{lm-eval task: alias} that a subset can be chosen from: a benchmark's leaves (its leaf tags), an lm-eval
    group's members, or the task itself; in a stable order."""
    if h.leaf_tags:
        names = sorted(n for tag in h.leaf_tags for n in tm.task_index[tag].tags)
        return {n: n.removeprefix(h.lm_task + "_") for n in names}
    task = lmtasks.convert({h.lm_task: tm.task_index[h.lm_task]})[h.lm_task]
    return {m: m for m in task.members} if task.kind == "group" else {h.lm_task: h.lm_task}


def select(h: Harness, name: str, tm: Any, subtasks: list[str] | None, scratch: Path | None) -> dict[str, str]:
    """The leaves to run. For a subset, a group YAML of the same name that holds only the chosen leaves (and the
    group's aggregation) is written to `scratch`, to be indexed last."""
    all_leaves = leaves(h, tm)
    if not subtasks:
        return all_leaves
    by_alias = {alias: n for n, alias in all_leaves.items()}
    unknown = [s for s in subtasks if s not in by_alias]
    if unknown or len(all_leaves) == 1 and h.lm_task in all_leaves:
        raise UserError(f"unknown {name} subtask(s) {unknown or subtasks}; known: "
                        f"{', '.join(by_alias) if len(by_alias) > 1 else 'none (not a group)'}",
                        key=f"eval.subtasks.{name}")
    chosen = {by_alias[s]: s for s in subtasks}
    assert scratch is not None, "a subset needs a scratch folder"
    group_cfg = tm.task_index[h.lm_task].cfg or {}
    spec = {"group": h.lm_task, "task": list(chosen), "metadata": group_cfg.get("metadata", {}),
            **({"aggregate_metric_list": group_cfg["aggregate_metric_list"]}
               if "aggregate_metric_list" in group_cfg else {})}
    (scratch / f"{h.lm_task}_subset.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return chosen


def _unavailable(base: dict, reason: str) -> dict:
    return {**base, "status": "unavailable", "reason": reason, "value": None, "stderr": None, "n": 0}


@contextmanager
def prepared(name: str, cfg: EvalCfg) -> Iterator[Setup | str]:
    """The task built with its data loaded (or why its test set is unavailable), for one or more `evaluate` calls
    (several adapters scored on one task: evals/together.py)."""
    scratch = Path(tempfile.mkdtemp(prefix="tunelab-tasks-"))
    try:
        yield _setup(name, harness_of(name), cfg, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def evaluate(name: str, lm: Any, cfg: EvalCfg, samples_path: Path | None, setup: Setup | str | None = None) -> dict:
    """Score one task or group (on `setup` when it is `prepared` already); a dict for results.json (status ok or
    unavailable)."""
    if setup is None:
        with prepared(name, cfg) as setup:
            return evaluate(name, lm, cfg, samples_path, setup)
    h = harness_of(name)
    base = {"task": name, "metric": h.label, "headline": h.headline, "lm_eval_task": h.lm_task}
    if isinstance(setup, str):
        return _unavailable(base, setup)
    served = Counter(getattr(lm, "served", {}))
    out = _run(setup, lm, cfg)
    res = collect(setup, out, base, cfg, samples_path)
    res["served"] = _served(Counter(getattr(lm, "served", {})) - served)
    return res


def _setup(name: str, h: Harness, cfg: EvalCfg, scratch: Path) -> Setup | str:
    """The task manager, the subset, the data folder; the tasks built with their data loaded. A string says why
    the test set is unavailable."""
    nltk_data.ensure()  # before lm-eval imports a task's checker that wants NLTK data (ifeval's)
    builtin = lmdata.folders(h.lm_task, cfg.include_path) if h.builtin else []
    extra = [Path(cfg.include_path).expanduser()] if cfg.include_path else []
    tm = task_manager(builtin=builtin, extra=extra, own=not h.builtin)
    setup = Setup(name, h, select(h, name, tm, cfg.subtasks.get(name), scratch))
    if cfg.include_path and name in lmtasks.local(cfg.include_path):  # the user's own task: its data beside it
        index = lmtasks.convert(tm.task_index)
        ran = sorted({t.name for member in setup.chosen for t in lmtasks.leaves(member, index)})
        if why := lmdata.anchored(tm, ran, Path(cfg.include_path).expanduser(), scratch):
            return why
        setup.local = cfg.include_path
    elif h.builtin:
        root = sources.user_root(cfg.data_dir)
        if root is not None and name not in lmtasks.local(cfg.include_path):
            index = lmtasks.convert(tm.task_index)
            ran = sorted({t.name for member in setup.chosen for t in lmtasks.leaves(member, index)})
            if why := lmdata.overrides(tm, ran, root, scratch):
                return why
            setup.root, setup.source = root, f"local:{root}"
    elif h.local:
        choice = sources.choose(h.local, h.hub, list(setup.chosen.values()) if h.leaf_tags else ["main"],
                                cfg.data_dir, h.offline_hint)
        if choice.status != "ok":
            return choice.reason
        setup.root, setup.source = choice.root, choice.source
    else:
        setup.source = h.made_from
    roots = {h.local: str(setup.root)} if h.local and setup.root and not h.builtin else {}
    setup.tm = task_manager(roots, builtin=builtin, extra=[*extra, scratch], own=not h.builtin)
    return _load(setup)


def _load(setup: Setup) -> Setup | str:
    """lm-eval builds the task (or group) and loads its data here: a dataset it cannot load (the hub unreachable
    and nothing cached) makes the task unavailable, with lm-eval's reason."""
    try:
        loaded = setup.tm.load([setup.h.lm_task])
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; each means "no test set"
        if not setup.h.builtin:
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        ran = [t.name for t in lmtasks.leaves(setup.h.lm_task, lmtasks.convert(setup.tm.task_index))]
        if setup.local:  # the user's own task: eval.data_dir plays no part in it
            return (f"lm-eval could not load {setup.h.lm_task}'s data ({type(e).__name__}: {first}); check its "
                    f"YAML's dataset_path and dataset_kwargs in {setup.local} (relative data_files are found "
                    "beside the YAML)")
        files = lmdata.expected(setup.tm, ran)
        return (f"lm-eval could not load {setup.h.lm_task}'s data ({type(e).__name__}: {first}); offline, put "
                f"{', '.join(files[:3])}{', ...' if len(files) > 3 else ''} under eval.data_dir "
                "(<dir>/<task>/<split>.jsonl)")
    setup.loaded = (loaded["groups"] or loaded["tasks"])[setup.h.lm_task]
    return setup


def _run(setup: Setup, lm: Any, cfg: EvalCfg) -> dict:
    from unittest import mock

    import lm_eval
    import lm_eval.evaluator

    gen = {"max_gen_toks": cfg.max_new_tokens} if cfg.max_new_tokens else None
    # lm-eval describes the environment after every run (torch's collect_env: `pip list` and more in subprocesses,
    # about 3 s); results.json keeps tunelab's own provenance instead (suite.provenance), so that is skipped.
    with mock.patch.object(lm_eval.evaluator, "add_env_info", lambda results: None):
        return lm_eval.simple_evaluate(model=lm, tasks=[setup.loaded], task_manager=setup.tm, limit=cfg.limit_for(
            setup.name), log_samples=True, bootstrap_iters=BOOTSTRAP_ITERS, gen_kwargs=gen,
            apply_chat_template=cfg.chat_template)


def _served(diff: Counter) -> dict[str, dict[str, int]]:
    """{request type: {"engine" or "hf: why": requests}}: which code served this task's requests."""
    out: dict[str, dict[str, int]] = {}
    for (kind, path), n in sorted(diff.items()):
        out.setdefault(kind, {})[path] = n
    return out
