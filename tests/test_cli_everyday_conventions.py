"""CLI conventions: --version, -h as --help on every level, shell completion."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import tunelab


def test_version(cli):
    code, out, _ = cli("--version")
    assert code == 0 and out.strip() == f"tunelab {tunelab.__version__}"


@pytest.mark.parametrize("args", [[], ["export"], ["clean"], ["chat"], ["data", "build"], ["eval", "run"]])
def test_short_help_everywhere(cli, args):
    code, out, err = cli(*args, "-h")
    assert code == 0, err
    assert "Usage:" in out and "--help" in out and "-h" in out


def test_completion_is_installable_and_completes(cli):
    code, out, _ = cli("--help")
    assert "--install-completion" in out and "--show-completion" in out
    # What the installed bash hook does on <TAB>: run the `exp` script with the words so far in the environment
    # (click names the variable after the program, so this needs the console script, not python -m).
    script = Path(sys.executable).parent / "exp"
    assert script.is_file(), "the exp console script is installed with the package"
    env = {**os.environ, "_EXP_COMPLETE": "complete_bash", "COMP_WORDS": "exp export --m", "COMP_CWORD": "2"}
    proc = subprocess.run([str(script)], check=False, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["--merge"], proc.stderr[-2000:]
