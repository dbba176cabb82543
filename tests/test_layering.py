"""The layers of docs/ARCHITECTURE.md, as a rule read from the package itself: each folder of
platform/tunelab/ is a layer, and its `__init__` docstring says which folders it may import ("May import: core,
folders, ..."). Those lists must stack (each folder may import exactly the folders below it), no module may lie
loose at the package's root (the face `tunelab/__init__.py` aside), and every import points to its own folder or a
lower one:

    imports at module level or inside functions, absolute or relative (`from . import x`);
    every deferred import, which is always a `Lazy("module:attr")` literal (registry.Lazy): a registry's
    implementations sit at or below the folder that uses that registry (REGISTRY_STAGE), any other Lazy
    counts as an import of the module that writes it;

no import circle exists between modules, deferred imports included; and planning a matrix imports no
module above the planner, checked at run time in a fresh interpreter.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = REPO / "platform" / "tunelab"
# Which folder loads a registry's implementations (they may live there or lower).
REGISTRY_STAGE = {"MODELS": "models", "TEMPLATES": "data", "FORMATS": "data", "GENERATORS": "data",
                  "OPTIMIZERS": "train", "PEFT": "train", "ENGINES": "train", "TASKS": "evals",
                  # a tune: section's samplers and rung values (tunelab.tune); PRUNERS names no implementation
                  "SAMPLERS": "tune", "PRUNERS": "tune", "INTERMEDIATES": "tune"}


def may_import(init: Path) -> list[str]:
    """The folders a layer's `__init__` docstring says it may import."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    m = re.search(r"^May import: (.*?)\.?$", doc.replace("\n", " ").replace(" May import:", "\nMay import:"), re.M)
    assert m, f"{init.relative_to(REPO)}: its docstring says what it may import ('May import: core, folders.')"
    text = m.group(1).strip()
    return [] if text.startswith("nothing") else [w.strip() for w in text.split(",")]


def stack(found: dict[str, list[str]]) -> list[str]:
    """Folder -> what it may import, as a stack of layers lowest first; AssertionError where they do not stack."""
    order = sorted(found, key=lambda f: len(found[f]))
    for i, f in enumerate(order):
        assert found[f] == order[:i], (f"{f}/__init__.py may import {found[f]}; the folders below it are "
                                       f"{order[:i]}: each layer may import exactly the layers below it")
    return order


@cache
def folders() -> list[str]:
    """The layer folders, lowest first, as their `__init__` docstrings stack them."""
    return stack({p.parent.name: may_import(p) for p in sorted(PACKAGE.glob("*/__init__.py"))})


def layer(module: str) -> int | None:
    """A module's layer: its folder's place in the stack (the package's face, `tunelab`, is the lowest)."""
    parts = module.split(".")
    if parts[0] != "tunelab":
        return None
    if len(parts) == 1:
        return -1
    return folders().index(parts[1]) if parts[1] in folders() else None


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
    if lazy and module != "tunelab.core.registries":  # a registry's targets are its stage's imports (graph())
        found |= {t for t in lazy_targets(tree) if t in known}
    return found - {module}


def registry_targets() -> dict[str, list[str]]:
    """Registry name -> the modules its entries' Lazy implementations live in."""
    from tunelab.core import registries
    from tunelab.core.registry import Lazy, Registry

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
        stage = f"tunelab.{REGISTRY_STAGE[reg]}"  # the package of the folder that loads them
        g[stage] |= {t for t in targets if t in known and t != stage}
    return g


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in modules() if layer(m) is None)
    assert not unplaced, f"put these modules in a layer's folder (and docs/ARCHITECTURE.md): {unplaced}"


def test_the_root_holds_only_the_face():
    """Nothing lies loose at platform/tunelab/ but the package's face; the CLI's entry is the cli/ folder."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert not loose, loose


def test_the_layers_stack_in_the_order_the_architecture_draws():
    """docs/ARCHITECTURE.md draws the tree one line per folder, lowest layer last; the docstrings' stack agrees."""
    doc = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    drawn = re.findall(r"^([a-z_]+)/ ", doc.split("## Layers", 1)[1].split("```")[1], re.M)
    assert drawn[::-1] == folders(), (drawn, folders())


def test_imports_point_down_the_layers():
    wrong = [f"{a} ({_name(a)}) imports {b} ({_name(b)})"
             for a, deps in graph().items() for b in sorted(deps) if layer(b) > layer(a)]
    assert not wrong, "\n".join(wrong)


def test_every_registry_has_a_stage_and_its_implementations_sit_at_or_below_it():
    targets = registry_targets()
    assert set(targets) == set(REGISTRY_STAGE), "give a new registry its stage in REGISTRY_STAGE"
    wrong = [f"{reg}: {t} ({_name(t) if layer(t) is not None else 'no tunelab module'}) is above "
             f"{REGISTRY_STAGE[reg]}" for reg, ts in targets.items() for t in ts
             if t.startswith("tunelab") and (layer(t) is None or layer(t) > folders().index(REGISTRY_STAGE[reg]))]
    assert not wrong, "\n".join(wrong)


def _name(module: str) -> str:
    i = layer(module)
    return "the face" if i == -1 else folders()[i]


def test_config_is_pure_data():
    """config reads the registries' names and facts for its defaults and help texts, no implementation; and the
    digest of a local task folder's files (core/taskfiles.py), which an evaluation's id covers."""
    assert graph()["tunelab.core.config"] <= {"tunelab.core.errors", "tunelab.core.registry", "tunelab.core.registries",
                                              "tunelab.core.taskfiles"}
    assert graph()["tunelab.core.registries"] <= {"tunelab.core.registry", "tunelab.core.errors"}


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
from tunelab.core.registries import OPTIMIZERS
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
    above = [m for m in loaded if m not in parents and (layer(m) is None or layer(m) > folders().index("plan"))]
    assert "tunelab.plan" in loaded and not above, above


@pytest.mark.parametrize(("source", "where", "expected"), [
    ("def f():\n    from tunelab.run.runner import Runner\n", "tunelab.train.bad", {"tunelab.run.runner"}),
    ("from ..run.runner import Runner\n", "tunelab.train.bad", {"tunelab.run.runner"}),
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
    assert layer("tunelab.newthing") is None and layer("tunelab.train.anything") == folders().index("train")
    assert layer("tunelab") == -1 and layer("tunelab.cli.run") == len(folders()) - 1


def test_a_docstring_that_does_not_stack_is_refused(tmp_path):
    """The stack can fail: a folder that skips a layer below it, or may import one above it, is named."""
    init = tmp_path / "__init__.py"
    init.write_text('"""A folder.\n\nMay import: core,\nplan.\n"""\n')
    assert may_import(init) == ["core", "plan"]
    assert stack({"core": [], "plan": ["core"], "train": ["core", "plan"]}) == ["core", "plan", "train"]
    with pytest.raises(AssertionError, match="train/__init__.py may import"):
        stack({"core": [], "plan": ["core"], "train": ["plan"]})
    with pytest.raises(AssertionError, match="may import"):
        stack({"core": ["plan"], "plan": ["core"]})


def test_a_cell_reads_in_one_screen():
    """The cell's stages lean on an assembly (cell/assembly.py) that lists the parts of a run top to bottom, so
    the stages themselves import few tunelab modules."""
    assert len(graph()["tunelab.cell.stages"]) <= 10, sorted(graph()["tunelab.cell.stages"])
