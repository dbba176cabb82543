"""lm-eval's task index as the plan reads it: every task, group and tag name with its kind and output type.

`eval.tasks` may name any lm-eval task or group besides tunelab's own (tunelab.core.registries.TASKS), and the tasks of
a local folder (`eval.include_path`, as `lm_eval --include_path`). `exp plan` checks those names here without
loading any data: lm-eval's index only parses its task YAMLs. Parsing its ~15k built-in tasks takes 10-20 s, so
that part is kept in tunelab's cache, one file per lm-eval version; an include_path folder is small and read
each time (its YAMLs change while someone writes a task).
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tunelab.core import taskfiles
from tunelab.core.files import read_json, write_json
from tunelab.core.paths import cache_dir

KINDS = {"TASK": "task", "PY_TASK": "task", "GROUP": "group", "TAG": "tag"}
# datasets' builders that read local files: their data_files are paths on this machine (a hub dataset's are its own)
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")
# The cached index's fields: 2 added the output type of tasks whose YAML names none, 3 a task's split and
# direction; a new format indexes again.
INDEX_FORMAT = 3


@dataclass(frozen=True)
class LmTask:
    name: str
    kind: str  # task | group | tag
    output_type: str  # a task's (multiple_choice, generate_until, loglikelihood, loglikelihood_rolling); "" unknown
    yaml: str | None  # the file that defines it
    members: tuple[str, ...] = ()  # a group's member names, a tag's tasks
    # The split a task scores, as its YAML says (lm-eval scores test_split when there is one, else
    # validation_split): "test", "validation", or "" when it names neither.
    split: str = ""
    metric: str = ""  # its first metric (the headline tunelab reports), a group's first aggregate metric
    higher_is_better: bool | None = None  # as the YAML says of that metric; None: lm-eval's default for it


def _members(kind: str, entry: Any) -> tuple[str, ...]:
    if kind == "tag":
        return tuple(sorted(entry.tags))
    listed = (entry.cfg or {}).get("task") if kind == "group" else None
    items = listed if isinstance(listed, list) else [listed] if listed else []
    return tuple(m if isinstance(m, str) else str(m.get("task") or m.get("group") or "") for m in items)


def _split(cfg: dict) -> str:
    return "test" if cfg.get("test_split") else "validation" if cfg.get("validation_split") else ""


def _first_metric(cfg: dict, kind: str) -> tuple[str, bool | None]:
    listed = cfg.get("aggregate_metric_list" if kind == "group" else "metric_list")
    first = (listed[0] if isinstance(listed, list) and listed else None) or {}
    if not isinstance(first, dict):
        return "", None
    hib = first.get("higher_is_better")
    return str(first.get("metric") or ""), hib if isinstance(hib, bool) else None


def convert(entries: dict[str, Any]) -> dict[str, LmTask]:
    """lm-eval's index entries (TaskManager.task_index) as LmTasks."""
    out = {}
    for name, e in entries.items():
        kind = KINDS.get(e.kind.name, "task")
        cfg = e.cfg if isinstance(e.cfg, dict) else {}
        # a YAML that names none runs lm-eval's default; a Python class task says nothing in its YAML
        output = (str(cfg.get("output_type") or ("python class" if "class" in cfg else "generate_until"))
                  if kind == "task" else "")
        metric, hib = _first_metric(cfg, kind)
        out[name] = LmTask(name, kind, output, str(e.yaml_path) if e.yaml_path else None, _members(kind, e),
                           _split(cfg) if kind == "task" else "", metric, hib)
    return out


def _scan(paths: list[Path]) -> dict[str, LmTask]:
    """lm-eval's own index of these folders (YAML only: no dataset is opened, no function imported)."""
    from lm_eval.tasks import TaskManager

    return convert(TaskManager(include_path=[str(p) for p in paths], include_defaults=False).task_index)


def lm_eval_version() -> str:
    return importlib.metadata.version("lm_eval")


def index_file() -> Path:
    """Where lm-eval's own index is kept, one file per lm-eval version and INDEX_FORMAT."""
    return cache_dir() / "lm-eval-index" / f"{lm_eval_version()}-{INDEX_FORMAT}.json"


@functools.cache
def builtin() -> dict[str, LmTask]:
    """Every task lm-eval ships, from the cache when this lm-eval version was indexed before."""
    path = index_file()
    cached = read_json(path, dict)  # damaged: indexed again
    if cached:
        return {n: LmTask(**{**v, "members": tuple(v["members"])}) for n, v in cached.items()}
    import lm_eval.tasks

    found = _scan([Path(lm_eval.tasks.__file__).parent])
    write_json(path, {n: asdict(t) for n, t in found.items()})
    return found


def local(include_path: str | None) -> dict[str, LmTask]:
    """The tasks of an include_path folder ({} without one)."""
    return _scan([Path(include_path).expanduser()]) if include_path else {}


def leaves(name: str, index: dict[str, LmTask]) -> list[LmTask]:
    """The tasks a name runs: itself, a group's members' tasks (recursively), a tag's tasks."""
    out: dict[str, LmTask] = {}

    def walk(n: str, seen: frozenset[str]) -> None:
        t = index.get(n)
        if t is None or n in seen:
            return
        if t.kind == "task":
            out.setdefault(n, t)
        for m in t.members:
            walk(m, seen | {n})

    walk(name, frozenset())
    return list(out.values())


def output_types(name: str, index: dict[str, LmTask]) -> str:
    """What kind of requests a name makes: a task's output type, a group's or tag's set of them."""
    kinds = sorted({t.output_type for t in leaves(name, index) if t.output_type})
    return ", ".join(kinds) or "?"


def find(name: str, include_path: str | None) -> LmTask | None:
    """The task or group lm-eval runs by `name` (include_path's first: it may redefine one)."""
    return local(include_path).get(name) or builtin().get(name)


def split_of(name: str, include_path: str | None) -> str:
    """The split `name` scores: "test" when it or any task of its group scores a test split, "validation" when
    every one scores a validation split, "" when a YAML names neither (or lm-eval does not know the name)."""
    index = {**builtin(), **local(include_path)}
    splits = {t.split for t in leaves(name, index)}
    if not splits:
        return ""
    return "test" if "test" in splits else "validation" if splits == {"validation"} else ""


def higher_is_better(name: str, include_path: str | None) -> bool:
    """The direction of the headline tunelab reports for `name`: its (or its group's) first metric, as the YAML
    says, else lm-eval's default for that metric (perplexities lower, accuracies higher)."""
    index = {**builtin(), **local(include_path)}
    found = index.get(name)
    firsts = [found] if found is not None and found.kind == "group" and found.metric else []
    for t in [*firsts, *leaves(name, index)]:
        if t.higher_is_better is not None:
            return t.higher_is_better
        if t.metric:
            import lm_eval.api.metrics  # noqa: F401 - registers the metrics' defaults
            from lm_eval.api.registry import is_higher_better

            default = is_higher_better(t.metric)
            return True if default is None else bool(default)
    return True


def refused(name: str, include_path: str | None) -> str | None:
    """None when lm-eval knows `name` as a task or group (include_path's first: it may redefine one); "" when it
    does not know it at all; else why it cannot be run (a tag)."""
    found = find(name, include_path)
    if found is None:
        return ""
    if found.kind != "tag":
        return None
    shown = ", ".join(found.members[:5]) + (", ..." if len(found.members) > 5 else "")
    return (f"{name!r} is an lm-eval tag of {len(found.members)} tasks ({shown}), which lm-eval scores one by one "
            "without a combined score: name the tasks, or a group of them defined in eval.include_path")


def unknown(names: list[str], include_path: str | None, known: list[str]) -> str:
    """The message for names that are neither tunelab's (`known`) nor lm-eval's, with the closest names."""
    everything = [*known, *local(include_path), *(n for n, t in builtin().items() if t.kind != "tag")]
    close = {n: c for n in names if (c := difflib.get_close_matches(n, everything, n=3, cutoff=0.75))}
    hint = "; ".join(f"for {n!r} did you mean {' or '.join(map(repr, c))}?" for n, c in close.items())
    where = ", nor of eval.include_path" if include_path else ""
    return (f"unknown task(s) {names}: not tunelab's ({', '.join(known)}), nor lm-eval's tasks or groups{where}"
            f"{'; ' + hint if hint else ''} (`exp ls tasks --all` lists lm-eval's)")


def local_data(tm: Any, leaves: list[str], root: Path) -> dict[str, list[tuple[str, str, Path]]]:
    """task -> (split, data file as written, where it is: core.taskfiles.data_file) of each leaf of an
    include_path folder (lm-eval's TaskManager `tm` over it) that reads local files."""
    out: dict[str, list[tuple[str, str, Path]]] = {}
    for leaf in leaves:
        entry = tm.task_index[leaf]
        cfg = entry.cfg or {}
        if cfg.get("dataset_path") not in LOCAL_BUILDERS or entry.yaml_path is None:
            continue
        here = Path(entry.yaml_path).parent
        out[leaf] = [(split, name, taskfiles.data_file(name, here, root)) for split, name in
                     taskfiles.written_files(cfg)]
    return out


def missing_data(tm: Any, leaves: list[str], root: Path) -> list[str]:
    """Each data file an include_path task names that is not there, in words."""
    out = []
    for leaf, found in local_data(tm, leaves, root).items():
        yaml_file = Path(tm.task_index[leaf].yaml_path)
        for split, name, path in found:
            if not path.is_file():
                looked = [path] if Path(name).expanduser().is_absolute() else [
                    yaml_file.parent.absolute() / name, root.absolute() / name, Path.cwd() / name]
                where = ", ".join(map(str, dict.fromkeys(looked)))
                out.append(f"task {leaf}: data_files{f' {split}' if split else ''}: {name!r} is no file (looked for "
                           f"{where}); a relative name is found beside the task's YAML")
    return out


def local_problems(names: list[str], include_path: str) -> list[str]:
    """What `exp plan` can say of the include_path tasks among `names` without loading a dataset: the data files
    their YAMLs name that are missing."""
    from lm_eval.tasks import TaskManager

    root = Path(include_path).expanduser()
    tm = TaskManager(include_path=[str(root)], include_defaults=False)
    index = convert(tm.task_index)
    ran = sorted({t.name for n in names if n in index for t in leaves(n, index)})
    return missing_data(tm, ran, root)
