"""Every file and folder name of a cell's folder is spelled only in `CellFolder` (folders/cell.py), every name of
a matrix's run folder only in `MatrixFolder` (folders/matrix.py), and a lock file's name only in core/locks.py:
everything else asks them for a path. The names are read from the owners themselves (their `At(...)` parts), so a
new file of a folder joins the check when its owner declares it."""

from __future__ import annotations

import ast
import re

from conftest import REPO

PACKAGE = REPO / "platform" / "tunelab"
OWNERS = {PACKAGE / "folders" / "cell.py", PACKAGE / "folders" / "matrix.py", PACKAGE / "core" / "locks.py"}


FILE_NAME = re.compile(r"^[\w.-]*\.[a-z]+$")
# A model folder's own files (final/ holds one): the Hugging Face format names them, not tunelab's layout.
FORMAT_NAMES = {"config.json", "adapter_config.json"}


def owned_names() -> tuple[set[str], set[str]]:
    """(file names, folder names) the owners declare: every part of an `At(...)` (a part with a dot is a file),
    and every other string of theirs that is a file name (`trials.json`)."""
    parts: set[str] = {"nodes"}  # nodes/node-R/: the other nodes' logs
    for path in OWNERS:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "At":
                parts |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and FILE_NAME.match(node.value) \
                    and node.value not in FORMAT_NAMES:
                parts.add(node.value)
    return {p for p in parts if "." in p}, {p for p in parts if "." not in p}


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def spelled(source: str) -> list[tuple[int, str]]:
    """(line, literal) of every owned name used to build a path in `source`: a string with no space whose
    '/'-separated parts include an owned file name (or `leaderboard.*`), or an owned folder name divided onto a
    path (`x / "eval"`) or handed to joinpath."""
    files, dirs = owned_names()
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                and " " not in node.value:
            bits = node.value.replace("*", "").split("/")
            if any(b in files or b.startswith("leaderboard.") for b in bits):
                found.append((node.lineno, node.value))
        operands = []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            operands = [node.right]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "joinpath":
            operands = node.args
        found += [(o.lineno, o.value) for o in operands
                  if isinstance(o, ast.Constant) and isinstance(o.value, str) and o.value in dirs]
    return found


def test_the_folders_names_are_spelled_only_by_their_owners():
    wrong = [f"{path.relative_to(PACKAGE)}:{line}: {literal!r}"
             for path in sorted(PACKAGE.rglob("*.py")) if path not in OWNERS
             for line, literal in spelled(path.read_text())]
    assert not wrong, "ask CellFolder / MatrixFolder / EvalFolder for these paths:\n" + "\n".join(wrong)


def test_the_check_catches_a_spelled_name():
    """It can fail: each way of building a path from a folder's name is found."""
    files, dirs = owned_names()
    assert {"results.json", "cell.json", "cells.json", "studies.json", "config.yaml", "trials.json", ".lock"} <= files
    assert {"final", "checkpoints", "eval", "tune"} <= dirs
    bad = ('p = folder / "eval" / eid / "results.json"\nq = mdir.joinpath("tune")\n'
           'r = f"tune/{s}/trials.json"\nlb = mdir / "leaderboard.md"\n')
    assert sorted(lit for _, lit in spelled(bad)) == ["/trials.json", "eval", "leaderboard.md", "results.json",
                                                      "tune"]
    fine = 'cfg["eval"] = 1\nmsg = "see results.json for why"\n"""A docstring: results.json."""\n'
    assert spelled(fine) == []
