"""Where the data of lm-eval's own tasks comes from (tunelab's tasks in tasks/ decide in sources.py).

lm-eval's task YAMLs name a hub dataset (`dataset_path`, `dataset_name`) and its splits. tunelab leaves that as it
is, except with a local folder (`eval.data_dir`, `$TUNELAB_EVAL_DATA`): there every leaf task reads
`<dir>/<task>/<split>.jsonl` for the splits its YAML names (test_split, validation_split, fewshot_split,
training_split), through a YAML written to a scratch folder that includes lm-eval's and overrides only the
dataset (indexed last, it takes the task's name). Tasks of `eval.include_path` are the user's own definitions and
read whatever their YAML names. Offline, a hub dataset loads only from the `datasets` cache: otherwise the task
is `unavailable` with lm-eval's reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tunelab.evals.testsets import sources
from tunelab.plan import lmtasks

SPLITS = ("training_split", "validation_split", "test_split", "fewshot_split")


def folders(name: str, include_path: str | None) -> list[Path]:
    """The folders of lm-eval's own tasks that define `name` and everything it runs: indexing only those takes a
    moment, where lm-eval's whole task tree takes many seconds. Empty for a task of include_path."""
    if name in lmtasks.local(include_path):
        return []
    index = lmtasks.builtin()
    found: set[Path] = set()

    def walk(n: str, seen: frozenset[str]) -> None:
        t = index.get(n)
        if t is None or n in seen:
            return
        if t.yaml:
            found.add(Path(t.yaml).parent)
        for m in t.members:
            walk(m, seen | {n})

    walk(name, frozenset())
    # a folder inside another one is indexed with it (indexing it twice would warn about every task in it)
    return sorted(d for d in found if not any(o != d and o in d.parents for o in found))


def overrides(tm: Any, leaves: list[str], root: Path, scratch: Path) -> str | None:
    """Point each leaf at `<root>/<leaf>/<split>.jsonl`; returns why not (the first missing test file), or None."""
    for leaf in leaves:
        entry = tm.task_index[leaf]
        cfg = entry.cfg or {}
        scored = cfg.get("test_split") or cfg.get("validation_split")
        files = {cfg[k]: root / leaf / f"{cfg[k]}.jsonl" for k in SPLITS if cfg.get(k)}
        if not scored or not files[scored].is_file():
            return (f"{root / leaf / f'{scored}.jsonl'} is missing under the data folder (eval.data_dir or "
                    f"${sources.ENV}): lm-eval's {leaf} scores its {scored} split")
        spec = {"include": str(entry.yaml_path), "task": leaf, "dataset_path": "json", "dataset_name": None,
                "dataset_kwargs": {"data_files": {s: str(p) for s, p in files.items() if p.is_file()}}}
        (scratch / f"{leaf}_local.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return None


def expected(tm: Any, leaves: list[str]) -> list[str]:
    """The files eval.data_dir would need for these leaves' scored splits, as <task>/<split>.jsonl."""
    out = []
    for leaf in leaves:
        cfg = tm.task_index[leaf].cfg or {}
        out.append(f"{leaf}/{cfg.get('test_split') or cfg.get('validation_split')}.jsonl")
    return out


def described(configs: dict[str, dict]) -> str:
    """Where the leaves' data came from, in words (results.json's data_source)."""
    out: dict[str, list[str]] = {}
    for cfg in configs.values():
        files = (cfg.get("dataset_kwargs") or {}).get("data_files")
        if files:
            where = f"files:{Path(next(iter(files.values()))).parent}" if isinstance(files, dict) else f"files:{files}"
            out.setdefault(where, [])
        else:
            out.setdefault(f"hub:{cfg.get('dataset_path')}", []).append(str(cfg.get("dataset_name") or ""))
    shown = []
    for where, found in out.items():
        names = sorted({n for n in found if n})
        shown.append(where + (f" ({names[0]})" if len(names) == 1 else f" ({len(names)} configs)" if names else ""))
    return "; ".join(shown)


def anchored(tm: Any, leaves: list[str], root: Path, scratch: Path) -> str | None:
    """Point the include_path tasks' relative data_files where they are (beside their YAML: core.taskfiles), through
    a YAML in `scratch` that includes theirs; returns why not (a missing file), or None. lm-eval's datasets would
    look for them in the folder exp runs in."""
    if problems := lmtasks.missing_data(tm, leaves, root):
        return "; ".join(problems)
    for leaf, found in lmtasks.local_data(tm, leaves, root).items():
        cfg = tm.task_index[leaf].cfg or {}
        where = {name: str(path.absolute()) for _, name, path in found}
        if all(Path(name).expanduser().is_absolute() for name in where):
            continue
        files = cfg["dataset_kwargs"]["data_files"]
        moved = {k: _moved(v, where) for k, v in files.items()} if isinstance(files, dict) else _moved(files, where)
        spec = {"include": str(Path(tm.task_index[leaf].yaml_path).absolute()), "task": leaf,
                "dataset_kwargs": {**cfg["dataset_kwargs"], "data_files": moved}}
        (scratch / f"{leaf}_anchored.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return None


def _moved(names: Any, where: dict[str, str]) -> Any:
    return [where.get(n, n) for n in names] if isinstance(names, list) else where.get(names, names)
