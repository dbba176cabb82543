"""The package passes its type check (mypy, at the level pyproject.toml's [tool.mypy] states), and keeps the
shape docs/ARCHITECTURE.md asks of it: no function longer than 60 lines."""

from __future__ import annotations

import ast
import subprocess
import sys

from conftest import REPO

MAX_FUNCTION_LINES = 60


def test_mypy_passes_on_the_package():
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_no_function_is_longer_than_sixty_lines():
    long = []
    for path in sorted((REPO / "platform" / "tunelab").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "\n".join(long)
