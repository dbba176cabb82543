"""Bad input, generated: thousands of inputs hypothesis makes up (random bytes, text that is not UTF-8, YAML
nested deeper than any parser recurses, numbers too large for any field, keys and values of every type,
paths that are files, devices, too long or not there) fed to the matrix loader, the `--set` parser, recipe
files and the CLI's path arguments. Whatever comes in: `exp` exits 0 or 2, prints no traceback, and writes
nothing a later run would trust. tests/test_bad_input.py names the cases one by one; this covers the ones
nobody named.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# Every example runs `exp` in-process (milliseconds for a refused input), so each suite stays within seconds.
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                          HealthCheck.too_slow])
KEYS = ["name", "base", "matrix", "include", "exclude", "seeds", "launcher", "description",
        "base.model.name", "base.data.recipe", "base.data.max_length", "base.train.steps", "base.train.batch_size",
        "base.optim.lr", "base.optim.name", "base.optim.kwargs", "base.peft.method", "base.peft.r",
        "base.parallel.dp", "base.parallel.backend", "base.eval.tasks", "base.eval.limit", "base.eval.suite",
        "matrix.optim.lr", "matrix.peft.method", "base.tracking.wandb"]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=10**18, max_value=10**400),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                    st.sampled_from(["tiny-random-llama", "arithmetic", "adamw", "lora", "native", "quick", "x/y",
                                     "../../etc/passwd", "~", "-1", "1e999", "null", "[1, 2", "{a: 1"]))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)


def exp(*args: object) -> tuple[int, str, str]:
    """`exp ARGS` in this process -> (exit code, stdout, stderr)."""
    from tunelab.cli import main

    out, err = io.StringIO(), io.StringIO()
    argv, sys.argv = sys.argv, ["exp", *map(str, args)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
    return code, out.getvalue(), err.getvalue()


def refused_cleanly(code: int, out: str, err: str, allowed: tuple[int, ...] = (0, 2)) -> None:
    assert code in allowed, (code, out[-400:], err[-1500:])
    assert "Traceback" not in out + err, err[-1500:]
    if code == 2:
        assert err.startswith("error:") or "Error" in err, err[-400:]  # the one paragraph (or typer's usage box)


def nest(raw: dict, dotted: str, value: object) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        raw = raw.setdefault(p, {}) if isinstance(raw.get(p, {}), dict) else raw
    raw[last] = value


def snapshot(root: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()} if root.exists() else {}


@pytest.fixture
def folder(tmp_path):
    return tmp_path


@FAST
@given(data=st.binary(max_size=400))
def test_a_matrix_file_of_any_bytes(folder, data):
    path = folder / "m.yaml"
    path.write_bytes(data)
    refused_cleanly(*exp("plan", path))


@FAST
@given(pairs=st.lists(st.tuples(st.sampled_from(KEYS), VALUES), max_size=8))
def test_a_matrix_of_any_keys_and_values(folder, pairs):
    raw: dict = {"name": "m", "base": {"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"}}}
    for key, value in pairs:
        nest(raw, key, value)
    path = folder / "m.yaml"
    path.write_text(yaml.safe_dump(raw, allow_unicode=True))
    runs = folder / "runs"
    before = snapshot(runs)
    code, out, err = exp("run", path, "--runs-dir", runs, "--set", "train.steps=0")  # steps 0: always refused
    refused_cleanly(code, out, err, allowed=(2,))
    assert snapshot(runs) == before  # refused before anything is written


@pytest.mark.parametrize("shape", ["[", "{a: ", "- "])
def test_yaml_nested_deeper_than_the_parser_recurses(folder, shape):
    """Each parser has a depth it cannot go past (Python's recursion limit); a file deeper than that is said so."""
    close = {"[": "]", "{a: ": "}", "- ": ""}[shape]
    text = "a: " + shape * 3000 + "1" + close * 3000 if close else "".join("  " * i + "- " + "\n" for i in range(3000))
    path = folder / "m.yaml"
    path.write_text(text)
    refused_cleanly(*exp("plan", path), allowed=(2,))


@FAST
@given(text=st.text(max_size=60), raw=st.binary(max_size=40))
def test_any_set_argument(folder, text, raw):
    path = folder / "m.yaml"
    path.write_text("name: m\nbase:\n  model: {name: tiny-random-llama}\n  data: {recipe: arithmetic}\n")
    for arg in (text, raw.decode("utf-8", "surrogateescape"), f"train.steps={text}", f"{text}=1"):
        if "\x00" in arg:
            continue  # an argv entry cannot hold NUL: no user can type it
        refused_cleanly(*exp("plan", path, "--set", arg))


@FAST
@given(data=st.one_of(st.binary(max_size=300), st.builds(lambda v: yaml.safe_dump(v).encode(), VALUES),
                      st.builds(lambda v: yaml.safe_dump({"sources": [v]}).encode(), VALUES)))
def test_a_recipe_file_of_anything(folder, data):
    (folder / "data_recipes").mkdir(exist_ok=True)
    (folder / "data_recipes" / "mine.yaml").write_bytes(data)
    path = folder / "m.yaml"
    path.write_text("name: m\nbase:\n  model: {name: tiny-random-llama}\n  data: {recipe: mine}\n")
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        refused_cleanly(*exp("plan", path))
    finally:
        os.chdir(cwd)


SPECIAL = ["/dev/null", "/proc/self/status", "/", "/etc", "/etc/passwd", "", ".", "..", "~", "-", "--",
           "x" * 300, "a/" * 200, "\udcff\udcfe", "nested/does/not/exist", "cells.json"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from(["plan", "status", "leaderboard", "report", "clean", "compare", "export", "run",
                                "chat"]),
       where=st.one_of(st.sampled_from(SPECIAL), st.text(min_size=1, max_size=30)))
def test_any_path_given_to_a_command(folder, command, where):
    if "\x00" in where:
        return  # an argv entry cannot hold NUL
    (folder / "afile").write_text("x")
    target = where if where.startswith(("/", "~")) or not where else str(folder / where)
    args = {"plan": [target], "status": [target], "leaderboard": [target], "report": [target, "--out", target],
            "clean": [target, "--yes"], "compare": [target, folder / "afile"],
            "export": [target, "--out", folder / "afile" / "x"], "run": [target, "--runs-dir", folder / "afile"],
            "chat": [folder / "afile", "--prompt", "x", "--template", "plain" if len(where) % 2 else where]}
    before = snapshot(folder)
    code, out, err = exp(command, *args[command])
    refused_cleanly(code, out, err)
    assert snapshot(folder) == before or command == "clean"
