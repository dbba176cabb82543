"""Every test the docs cite exists: a doc that says `tests/x.py` covers something must not outlive that file,
and a test named there (`tests/x.py::test_name`, `x.py::test_name` or a bare `test_name`) must still be defined.

The README, docs/*.md and benchmarks/*.md are scanned. A parametrized id's `[...]` is dropped; a name that a
line break splits after an underscore (docs/tuning.md wraps long names so) is joined before it is read."""

from __future__ import annotations

import ast
import functools
import re

import pytest
from conftest import REPO

DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "benchmarks").glob("*.md")])
TESTS = REPO / "tests"
# `tests/x.py`, `tests/parallel/x.py`, or a test module named without its folder (`test_x.py`)
FILE = re.compile(r"(?<![\w/.-])((?:tests/)?[\w/]*?test_\w+\.py|tests/[\w/]+\.py)(?:::(test_\w+))?")
NAME = re.compile(r"(?<![\w/.])(test_\w+)(?![\w.])")
NOT_TESTS = {"test_split"}  # names of other tools that look like tests: lm-eval's task YAML key


@functools.cache  # read once for all the docs
def defined_tests() -> dict[str, set[str]]:
    """{test module path relative to the repository: the test functions it defines}, every module under tests/."""
    found = {}
    for path in TESTS.rglob("*.py"):
        tree = ast.parse(path.read_text())
        found[path.relative_to(REPO).as_posix()] = {
            n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            and n.name.startswith("test_")}
    return found


def citations(text: str) -> tuple[list[tuple[str, str | None]], list[str]]:
    """([(cited file, cited test or None)], [bare test names]) of one doc."""
    text = re.sub(r"(test_\w*_)\n[ \t>*-]*(\w)", r"\1\2", text)  # a name wrapped after an underscore
    text = re.sub(r"\[[^\]\n]*\]", "", text)  # parametrized ids, and markdown link texts' brackets
    files = [(m.group(1), m.group(2)) for m in FILE.finditer(text)]
    rest = FILE.sub(" ", text)
    return files, [m.group(1) for m in NAME.finditer(rest) if m.group(1) not in NOT_TESTS]


def module_for(cited: str, modules: dict[str, set[str]]) -> str | None:
    """The test module a citation names: its path, or a file name under tests/ with no folder given."""
    if cited in modules:
        return cited
    if "/" not in cited:
        named = [m for m in modules if m.rsplit("/", 1)[-1] == cited]
        return named[0] if len(named) == 1 else None
    return None


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_test_a_doc_cites_exists(doc):
    modules = defined_tests()
    every_test = set().union(*modules.values())
    files, names = citations(doc.read_text())
    missing = []
    for cited, test in files:
        module = module_for(cited, modules)
        if module is None:
            missing.append(cited)
        elif test and test not in modules[module]:
            missing.append(f"{cited}::{test}")
    missing += [n for n in names if n not in every_test and f"tests/{n}.py" not in modules]
    assert not missing, f"{doc.relative_to(REPO)} cites tests that do not exist: {sorted(set(missing))}"


def test_the_check_finds_what_is_missing():
    """The scan itself: a cited file, a cited test and a wrapped bare name that are gone are all reported."""
    files, names = citations("see `tests/test_gone.py::test_x[a-b]`, tests/test_lint.py and `test_no_\n  such_one`")
    assert files == [("tests/test_gone.py", "test_x"), ("tests/test_lint.py", None)]
    assert names == ["test_no_such_one"]
    modules = defined_tests()
    assert module_for("tests/test_gone.py", modules) is None
    assert "test_ruff_is_clean" in modules[module_for("test_lint.py", modules)]
