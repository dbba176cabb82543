"""The stage order of docs/ARCHITECTURE.md, as a rule. Every tunelab module has a place in LAYERS (a module
the table does not place fails the test), and every import points to its own layer or a lower one:

    imports at module level or inside functions, absolute or relative (`from . import x`);
    every deferred import, which is always a `Lazy("module:attr")` literal (registry.Lazy): a registry's
    implementations sit at or below the stage that uses that registry (REGISTRY_STAGE), any other Lazy
    counts as an import of the module that writes it;

no import circle exists between modules, deferred imports included; and planning a matrix imports no
module above the planner, checked at run time in a fresh interpreter.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = REPO / "platform" / "tunelab"

# Lowest first. "pkg*" places a package and everything in it.
LAYERS: list[tuple[str, set[str]]] = [
    ("base", {"tunelab", "tunelab.errors", "tunelab.config", "tunelab.registry", "tunelab.registries",
              "tunelab.store", "tunelab.paths", "tunelab.events", "tunelab.services", "tunelab.cellfolder",
              "tunelab.matrixfolder", "tunelab.layouts", "tunelab.stepscores"}),
    # Optimizer classes import torch and each other only: the planner reads their constructors' signatures.
    ("optimizers", {"tunelab.train.optimizers*"}),
    ("plan", {"tunelab.plan*"}),
    ("runtime", {"tunelab.runtime"}),
    ("data", {"tunelab.data*"}),
    ("models", {"tunelab.models", "tunelab.catalog", "tunelab.env"}),
    ("train", {"tunelab.train*"}),
    ("evals", {"tunelab.evals*"}),
    ("report", {"tunelab.report*", "tunelab.tracking", "tunelab.listing"}),
    ("tools", {"tunelab.export", "tunelab.modelcard", "tunelab.chat", "tunelab.clean"}),
    ("orchestrate", {"tunelab.matrix", "tunelab.launch", "tunelab.outcome", "tunelab.slurm", "tunelab.runview",
                     "tunelab.runner", "tunelab.experiment", "tunelab.cell", "tunelab.inputs", "tunelab.tune*",
                     "tunelab.ckpteval", "tunelab.beside", "tunelab.along"}),
    ("cli", {"tunelab.cli*"}),
]
NAMES = [name for name, _ in LAYERS]
# Which stage loads a registry's implementations (they may live there or lower).
REGISTRY_STAGE = {"MODELS": "models", "TEMPLATES": "data", "FORMATS": "data", "GENERATORS": "data",
                  "OPTIMIZERS": "train", "PEFT": "train", "ENGINES": "train", "TASKS": "evals",
                  # a tune: section's samplers and rung values (tunelab.tune); PRUNERS names no implementation
                  "SAMPLERS": "orchestrate", "PRUNERS": "orchestrate", "INTERMEDIATES": "orchestrate"}


def layer(module: str) -> int | None:
    for i, (_, patterns) in enumerate(LAYERS):
        for p in patterns:
            if module == p or (p.endswith("*") and (module == p[:-1] or module.startswith(p[:-1] + "."))):
                return i
    return None


@cache
def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        out[".".join(rel.parts).removesuffix(".__init__")] = path
    return out


def _absolute(node: ast.ImportFrom, module: str, path: Path) -> str:
    """The module a `from X import ...` names, relative imports resolved against the importing module."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def lazy_targets(tree: ast.AST) -> list[str]:
    """The modules of every `Lazy("module:attr")` literal."""
    return [n.args[0].value.partition(":")[0] for n in ast.walk(tree)
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Lazy" and n.args
            and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)]


def imports(path: Path, module: str, known: dict[str, Path], lazy: bool = True) -> set[str]:
    """The tunelab modules `path` imports anywhere in its body (and defers with Lazy, unless lazy=False)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, path)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
    if lazy and module != "tunelab.registries":  # a registry's targets are its stage's imports (graph())
        found |= {t for t in lazy_targets(tree) if t in known}
    return found - {module}


def registry_targets() -> dict[str, list[str]]:
    """Registry name -> the modules its entries' Lazy implementations live in."""
    from tunelab import registries
    from tunelab.registry import Lazy, Registry

    out = {}
    for name, reg in vars(registries).items():
        if isinstance(reg, Registry):
            found = []
            for _, entry in reg.items():
                values = [entry] if isinstance(entry, Lazy) else list(getattr(entry, "__dict__", {}).values())
                found += [v.target.partition(":")[0] for v in values if isinstance(v, Lazy)]
            out[name] = found
    return out


@cache
def graph() -> dict[str, set[str]]:
    """Module -> what it imports; a registry's implementations hang off the package of its stage."""
    known = modules()
    g = {name: imports(path, name, known) for name, path in known.items()}
    for reg, targets in registry_targets().items():
        stage = {"models": "tunelab.models", "data": "tunelab.data", "train": "tunelab.train",
                 "evals": "tunelab.evals", "orchestrate": "tunelab.tune"}[REGISTRY_STAGE[reg]]
        g[stage] |= {t for t in targets if t in known and t != stage}
    return g


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in modules() if layer(m) is None)
    assert not unplaced, f"place these modules in LAYERS (and docs/ARCHITECTURE.md): {unplaced}"


def test_imports_point_down_the_layers():
    wrong = [f"{a} ({NAMES[layer(a)]}) imports {b} ({NAMES[layer(b)]})"
             for a, deps in graph().items() for b in sorted(deps) if layer(b) > layer(a)]
    assert not wrong, "\n".join(wrong)


def test_every_registry_has_a_stage_and_its_implementations_sit_at_or_below_it():
    targets = registry_targets()
    assert set(targets) == set(REGISTRY_STAGE), "give a new registry its stage in REGISTRY_STAGE"
    wrong = [f"{reg}: {t} ({NAMES[layer(t)] if layer(t) is not None else 'no tunelab module'}) is above "
             f"{REGISTRY_STAGE[reg]}" for reg, ts in targets.items() for t in ts
             if t.startswith("tunelab") and (layer(t) is None or layer(t) > NAMES.index(REGISTRY_STAGE[reg]))]
    assert not wrong, "\n".join(wrong)


def test_config_is_pure_data():
    """config reads the registries' names and facts for its defaults and help texts, no implementation."""
    assert graph()["tunelab.config"] <= {"tunelab.errors", "tunelab.registry", "tunelab.registries"}
    assert graph()["tunelab.registries"] <= {"tunelab.registry", "tunelab.errors"}


def test_no_import_circles():
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

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


PLAN_EVERY_OPTIMIZER = """
import json, sys
from tunelab import plan
from tunelab.registries import OPTIMIZERS
for name in OPTIMIZERS:
    plan.cell_config({"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"},
                      "optim": {"name": name}, "eval": {"suite": "quick"}})
print(json.dumps(sorted(m for m in sys.modules if m.startswith("tunelab"))))
"""


def test_planning_imports_nothing_above_the_planner():
    """At run time, not only in the source: the planner checks every optimizer (it reads constructors) and a
    suite, and the interpreter then holds no tunelab module above the plan layer."""
    out = subprocess.run([sys.executable, "-c", PLAN_EVERY_OPTIMIZER], check=True, capture_output=True, text=True,
                         cwd=REPO)
    loaded = json.loads(out.stdout)
    # A placed module's parent packages are imported with it (their __init__ obeys the static rules above).
    parents = {".".join(m.split(".")[:i]) for m in loaded for i in range(1, m.count(".") + 1)}
    above = [m for m in loaded if m not in parents and (layer(m) is None or layer(m) > NAMES.index("plan"))]
    assert "tunelab.plan" in loaded and not above, above


@pytest.mark.parametrize(("source", "where", "expected"), [
    ("def f():\n    from tunelab.runner import Runner\n", "tunelab.train.bad", {"tunelab.runner"}),
    ("from ..runner import Runner\n", "tunelab.train.bad", {"tunelab.runner"}),
    ("from . import loop\n", "tunelab.train.bad", {"tunelab.train.loop"}),
    ("X = Lazy('tunelab.report.table:build')\n", "tunelab.train.bad", {"tunelab.report.table"}),
])
def test_the_rule_catches_a_bad_import(tmp_path, source, where, expected):
    """The checks above can fail: a stage reaching the runner (in a function, or relatively), or a report
    module through a Lazy, is an import of it, and one that points up."""
    bad = tmp_path / "bad.py"
    bad.write_text(source)
    found = imports(bad, where, modules())
    assert found == expected
    assert all(layer(m) is not None for m in found)
    if expected != {"tunelab.train.loop"}:
        assert max(layer(m) for m in found) > layer(where)


def test_an_unplaced_module_is_named():
    assert layer("tunelab.newthing") is None and layer("tunelab.train.anything") == NAMES.index("train")
    assert fnmatch.fnmatch("tunelab.cli.run", "tunelab.cli*")
