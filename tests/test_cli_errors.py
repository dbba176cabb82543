"""Bad input: exit code 2, one paragraph naming file and key, no traceback, nothing on disk."""

from __future__ import annotations

import pytest
from conftest import write

GOOD = """name: bad
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic}
"""

CASES = {
    "yaml_syntax": (GOOD + "matrix:\n  optim.name: [adamw\n  peft.method: [none]\n", ["line 7", "YAML syntax"]),
    "unknown_key": (GOOD.replace("{recipe: arithmetic}", "{recipe: arithmetic, maxlen: 3}"),
                    ["base.data.maxlen", "unknown key", "max_length"]),
    "wrong_type": (GOOD + "  train: {steps: ten}\n", ["base.train.steps", "integer", "'ten'"]),
    "empty_axis": (GOOD + "matrix:\n  peft.method: []\n", ["matrix.peft.method", "at least one value"]),
    "unknown_model": (GOOD.replace("tiny-random-llama", "no such model"),
                      ["base.model.name", "not a catalog alias", "tiny-random-llama"]),
    "unknown_optimizer": (GOOD + "matrix:\n  optim.name: [adamw, adamz]\n",
                          ["matrix.optim.name[1]", "unknown optimizer", "adamw"]),
    "unknown_recipe": (GOOD.replace("recipe: arithmetic", "recipe: nope"), ["base.data.recipe", "no recipe 'nope'"]),
    "unknown_peft": (GOOD + "matrix:\n  peft.method: [lora, loar]\n", ["matrix.peft.method[1]", "'lora'"]),
    "top_level_key": (GOOD + "seedz: [1]\n", ["seedz", "unknown key", "seeds"]),
    "not_a_mapping": ("- just\n- a list\n", ["a matrix file is a mapping"]),
}


@pytest.mark.parametrize("command", ["run", "plan"])
@pytest.mark.parametrize("case", list(CASES))
def test_bad_matrix(cli, tmp_path, case, command):
    text, needles = CASES[case]
    path = write(tmp_path / f"{case}.yaml", text)
    runs = tmp_path / "runs"
    args = [command, path] + (["--runs-dir", runs] if command == "run" else [])
    code, out, err = cli(*args)
    assert code == 2, (out, err)
    assert "Traceback" not in out + err
    message = " ".join(err.split())  # rich wraps long lines
    assert f"{case}.yaml" in message
    for needle in needles:
        assert needle in message, message
    assert not runs.exists()


def test_a_model_folder_missing_here_plans_but_does_not_run(cli, tmp_path):
    """A path is checked on the machine that runs the cell (it may exist on the cluster), never at plan time."""
    path = write(tmp_path / "m.yaml", GOOD.replace("tiny-random-llama", "./no/such/model"))
    code, out, err = cli("plan", path)
    assert code == 0, err
    code, out, err = cli("run", path, "--runs-dir", tmp_path / "runs")
    message = " ".join(err.split())
    assert code == 2 and "m.yaml" in message and "model.name" in message and "no folder" in message, message
    assert "Traceback" not in out + err and not (tmp_path / "runs").exists()


def test_missing_file(cli, tmp_path):
    code, out, err = cli("run", tmp_path / "nope.yaml", "--runs-dir", tmp_path / "runs")
    assert code == 2 and "nope.yaml: no such file" in " ".join(err.split())
    assert not (tmp_path / "runs").exists()


def test_only_matching_nothing(cli, tmp_path):
    path = write(tmp_path / "m.yaml", GOOD)
    code, _, err = cli("run", path, "--only", "zzz*", "--runs-dir", tmp_path / "runs")
    assert code == 2 and "matches none of the cells" in err
    assert not (tmp_path / "runs").exists()


def test_status_of_missing_folder(cli, tmp_path):
    code, _, err = cli("status", tmp_path / "nothing")
    assert code == 2 and "no such run folder" in err
