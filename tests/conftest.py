"""Shared fixtures: one model/data cache per test session, W&B off unless a test turns it on."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _threads() -> str:
    """Threads for each test's torch: the cores shared among pytest-xdist's workers (`-n N`), so that workers and
    the processes their tests start do not oversubscribe the machine (OpenMP's waiting threads then spin against
    each other); alone, OMP_NUM_THREADS as set (2 by default)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        return str(max(1, (os.cpu_count() or 1) // workers))
    return os.environ.get("OMP_NUM_THREADS", "2")


# Set at import, before any test module imports torch (which reads it once).
os.environ["OMP_NUM_THREADS"] = _threads()


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (minutes each)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow") or os.environ.get("TUNELAB_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --slow (or TUNELAB_SLOW=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("tunelab-cache")
    os.environ["TUNELAB_CACHE"] = str(cache)
    os.environ.setdefault("WANDB_MODE", "disabled")
    os.environ["HF_HUB_OFFLINE"] = "1"
    yield cache


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run `exp ARGS` in-process; returns (exit code, stdout, stderr)."""
    from tunelab.cli import main

    def run(*args: str, cwd: Path | None = None):
        if cwd:
            monkeypatch.chdir(cwd)
        monkeypatch.setattr(sys, "argv", ["exp", *map(str, args)])
        capsys.readouterr()  # what the test printed before (a library's warnings) is not this command's output
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def tmpfs():
    """mount(where, options): a tmpfs of its own at `where` (a full disk, a read-only folder), unmounted after the
    test; the test is skipped, saying why, where this machine does not let it mount (not root, a container)."""
    import subprocess

    mounted: list[Path] = []

    def mount(where: Path, options: str) -> Path:
        where.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tunelab-test", str(where)], check=False,
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'mount failed'}): needs root")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(folder: Path) -> None:
    """Write into `folder` until its file system is full (a tmpfs of a few KiB)."""
    fd = os.open(folder / "ballast", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:  # full
        pass
    finally:
        os.close(fd)
