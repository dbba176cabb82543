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


def lm_eval_rows(include_path: str | None = None) -> list[tuple[str, str]]:
    """(name, kind and output type) of every task and group lm-eval ships (and include_path holds), for
    `exp ls tasks --all`: what `eval.tasks` can name besides tunelab's own. Tags are left out: they are not
    runnable as one task."""
    from tunelab.plan import lmtasks

    index = {**lmtasks.builtin(), **lmtasks.local(include_path)}
    out = []
    for name in sorted(set(index) - set(registries.TASKS)):  # a name tunelab's tasks take means tunelab's
        t = index[name]
        if t.kind == "task":
            out.append((name, f"lm-eval task, {t.output_type or '?'}"))
        elif t.kind == "group":
            out.append((name, f"lm-eval group of {len(lmtasks.leaves(name, index))} tasks, "
                              f"{lmtasks.output_types(name, index)}"))
    return out


def _registered(registry: registries.Registry) -> list[tuple[str, str]]:
    return [(n, entry.description) for n, entry in registry.items()]


# kind -> its (name, one-line description) rows; everything: lm-eval's tasks and groups after tunelab's tasks
ROWS: dict[str, Callable[[bool], list[tuple[str, str]]]] = {
    "models": lambda _: _registered(registries.MODELS),
    "recipes": lambda _: _content("data_recipes"),
    "suites": lambda _: _content("evals"),
    "tasks": lambda everything: _registered(registries.TASKS) + (lm_eval_rows() if everything else []),
    "optimizers": lambda _: _registered(registries.OPTIMIZERS),
    "peft": lambda _: _registered(registries.PEFT),
    "engines": lambda _: _registered(registries.ENGINES),
    "samplers": lambda _: _registered(registries.SAMPLERS),  # tune.sampler (docs/tuning.md)
    "pruners": lambda _: _registered(registries.PRUNERS),
    "intermediates": lambda _: _registered(registries.INTERMEDIATES),  # tune.intermediate
    "experiments": lambda _: _content("experiments"),
}
KINDS = tuple(ROWS)


def rows(kind: str, everything: bool = False) -> list[tuple[str, str]]:
    """(name, one-line description) of every choice of `kind` (one of KINDS); `everything`: with lm-eval's tasks
    and groups after tunelab's tasks."""
    if kind not in ROWS:
        raise ValueError(f"unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
    return ROWS[kind](everything)


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
