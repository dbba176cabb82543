"""The import layering of docs/ARCHITECTURE.md, as a rule: every tunelab import (at module level or inside a
function) points down or sideways, and no import circle exists between modules.

    5 cli          tunelab.cli, the stage CLIs (data.cli, evals.cli, train.parallel.cli) and *_cli modules
    4 orchestrate  runner, cell, launch, matrix
    3 stages       data, train, evals, report, models, tracking, env, chat/export/clean helpers
    2 runtime      the machine meets the config (device, dtype, process group)
    1 plan         plan-time checks that need registries and content folders
    0 base         config (pure data), errors, store, paths, registry, registries, events, folders
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "platform" / "tunelab"
BASE = {"config", "errors", "store", "paths", "registry", "registries", "events", "folders", "__init__"}
ORCHESTRATE = {"runner", "cell", "launch", "matrix"}


def layer(module: str) -> int:
    parts = module.split(".")[1:] or ["__init__"]  # drop "tunelab"; the package itself only has __version__
    if parts[-1] == "cli" or parts[-1].endswith("_cli"):
        return 5
    if parts[0] in ORCHESTRATE:
        return 4
    if parts[0] == "runtime":
        return 2
    if parts[0] == "plan":
        return 1
    if len(parts) == 1 and parts[0] in BASE:
        return 0
    return 3


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The tunelab modules `path` imports anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def test_imports_point_down_the_layers():
    wrong = [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
             for a, deps in graph().items() for b in sorted(deps) if layer(b) > layer(a)]
    assert not wrong, "\n".join(wrong)


def test_config_is_a_leaf():
    """Pure data: config reads the registries' names for its help text (names and facts, no implementation)."""
    assert graph()["tunelab.config"] <= {"tunelab.errors", "tunelab.registries"}
    assert graph()["tunelab.registries"] <= {"tunelab.registry"}


def test_no_import_circles():
    g = graph()
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not circles, circles


def test_the_rule_catches_a_bad_import(tmp_path):
    """The checks above can fail: a stage importing the runner is reported."""
    assert layer("tunelab.train.loop") == 3 and layer("tunelab.runner") == 4
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from tunelab.runner import run_cells\n")
    assert imports(bad, modules()) == {"tunelab.runner"}
