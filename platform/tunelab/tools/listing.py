"""What there is to choose from: every name a matrix may use, with one line each (`exp ls`, docs tables).

Registered names come with their registry entry's description (tunelab.core.registries); content files
(recipes, suites, experiments) with their own `description` key.
"""

from __future__ import annotations

from collections.abc import Callable

import yaml

from tunelab.core import paths, registries


def _states(states) -> str:
    return "factored (rows + columns)" if states == "factored" else f"{states:g}"


def _content(kind: str) -> list[tuple[str, str]]:
    """(name, description) of the YAML files of a content folder (data_recipes/, evals/, experiments/)."""
    out = []
    for name in paths.available(kind):
        path = paths.find_named(kind, name)
        try:
            data = yaml.safe_load(path.read_text()) if path else {}
        except (OSError, yaml.YAMLError):
            data = {}
        text = data.get("description", "") if isinstance(data, dict) else ""
        out.append((name, " ".join(str(text).split()) or "(no description)"))
    return out


def lm_eval_rows(include_path: str | None = None, builtin: bool = True) -> list[tuple[str, str]]:
    """(name, kind and output type) of every task and group lm-eval ships (`builtin`) and include_path holds, for
    `exp ls tasks --all` / `--include-path`: what `eval.tasks` can name besides tunelab's own. Tags are left out:
    they are not runnable as one task."""
    from tunelab.plan import lmtasks

    local = lmtasks.local(include_path)
    index = {**(lmtasks.builtin() if builtin else {}), **local}
    out = []
    for name in sorted(set(index) - set(registries.TASKS)):  # a name tunelab's tasks take means tunelab's
        t, whose = index[name], f"{include_path}: " if name in local else "lm-eval "
        if t.kind == "task":
            out.append((name, f"{whose}task, {t.output_type or '?'}"))
        elif t.kind == "group" and (n := len(lmtasks.leaves(name, index))):
            out.append((name, f"{whose}group of {n} tasks, {lmtasks.output_types(name, index)}"))
        elif t.kind == "group":  # its members are made by lm-eval when it loads the group (not in the index)
            out.append((name, f"{whose}group, members made when lm-eval loads it"))
    return out


def matching(found: list[tuple[str, str]], pattern: str | None) -> list[tuple[str, str]]:
    """The rows whose name or description holds `pattern` (any case), or match it as a glob (`arc_*`)."""
    import fnmatch

    if not pattern:
        return found
    p = pattern.lower()
    glob = any(c in p for c in "*?[")
    return [(n, w) for n, w in found if (fnmatch.fnmatch(n.lower(), p) if glob else p in n.lower() or p in w.lower())]


def _registered(registry: registries.Registry) -> list[tuple[str, str]]:
    return [(n, entry.description) for n, entry in registry.items()]


def _tasks(everything: bool, include_path: str | None) -> list[tuple[str, str]]:
    own = _registered(registries.TASKS)
    return own + (lm_eval_rows(include_path, builtin=everything) if everything or include_path else [])


# kind -> its (name, one-line description) rows, given (everything: lm-eval's tasks and groups after tunelab's
# tasks, an include_path folder's tasks)
ROWS: dict[str, Callable[[bool, str | None], list[tuple[str, str]]]] = {
    "models": lambda *_: _registered(registries.MODELS),
    "recipes": lambda *_: _content("data_recipes"),
    "suites": lambda *_: _content("evals"),
    "tasks": _tasks,
    "optimizers": lambda *_: _registered(registries.OPTIMIZERS),
    "peft": lambda *_: _registered(registries.PEFT),
    "engines": lambda *_: _registered(registries.ENGINES),
    "samplers": lambda *_: _registered(registries.SAMPLERS),  # tune.sampler (docs/tuning.md)
    "pruners": lambda *_: _registered(registries.PRUNERS),
    "intermediates": lambda *_: _registered(registries.INTERMEDIATES),  # tune.intermediate
    "experiments": lambda *_: _content("experiments"),
}
KINDS = tuple(ROWS)


def rows(kind: str, everything: bool = False, include_path: str | None = None,
         pattern: str | None = None) -> list[tuple[str, str]]:
    """(name, one-line description) of every choice of `kind` (one of KINDS); `everything`: with lm-eval's tasks
    and groups after tunelab's tasks; `include_path`: with that folder's tasks; `pattern`: only the rows that
    match it (`matching`)."""
    if kind not in ROWS:
        raise ValueError(f"unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
    return matching(ROWS[kind](everything, include_path), pattern)


def optimizer_table() -> str:
    """The table of docs/optimizers.md, made from the registry (tests/test_registries.py keeps them equal)."""
    lines = ["| name | implementation | state per weight | usual fine-tuning lr | notes |", "|---|---|---|---|---|"]
    for name, o in registries.OPTIMIZERS.items():
        states = _states(o.states) + (f" (hidden matrices) / {_states(o.other_states)} (the rest)"
                                      if o.other_states is not None else "")
        notes = o.description + ("; updates inside backward" if o.fused else "")
        lines.append(f"| `{name}` | {o.source} | {states} | {o.lr} | {notes} |")
    lines += ["| `torch.optim.Name` | that class | | | any optimizer torch ships |",
              "| `package.module:Class` | that class | | | any `torch.optim.Optimizer` subclass taking "
              "`(params, lr=..., ...)` |"]
    return "\n".join(lines)
