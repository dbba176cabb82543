"""ruff, with the rules pyproject.toml configures, finds nothing in the package, the tests and the benchmarks."""

from __future__ import annotations

import shutil
import subprocess
import sys

from conftest import REPO


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or [sys.executable, "-m", "ruff"]
    cmd = [ruff] if isinstance(ruff, str) else ruff
    out = subprocess.run([*cmd, "check", "--no-cache", "platform", "tests", "benchmarks"], cwd=REPO,
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
