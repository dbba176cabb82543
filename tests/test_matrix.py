"""Matrix expansion, include/exclude/seeds, ids and slugs."""

from __future__ import annotations

import pytest
from conftest import write

from tunelab.core.errors import UserError
from tunelab.matrix import expansion

BASE = """
name: m
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic}
"""


def cells(tmp_path, body: str):
    return expansion.load(write(tmp_path / "m.yaml", BASE + body))[1]


def test_product_exclude_include_seeds(tmp_path):
    grid = "matrix:\n  optim.name: [adamw, sgd]\n  peft.method: [none, lora]\n"
    assert len(cells(tmp_path, grid)) == 4
    ex = grid + "exclude:\n  - {optim.name: sgd, peft.method: lora}\n"
    got = cells(tmp_path, ex)
    assert {c.slug for c in got} == {"adamw-none", "adamw-lora", "sgd-none"}
    inc = ex + "include:\n  - {optim.name: adam, peft.method: lora, optim.lr: 1.0e-4}\n"
    got = cells(tmp_path, inc)
    assert len(got) == 4 and got[-1].config.optim.lr == 1e-4 and got[-1].config.optim.name == "adam"
    assert "optim.lr" in got[-1].varying  # include brought a new varying key
    seeded = cells(tmp_path, inc + "seeds: [0, 1]\n")
    assert len(seeded) == 8
    assert {c.config.train.seed for c in seeded} == {0, 1}
    assert seeded[0].slug.endswith("-s0") and seeded[1].slug.endswith("-s1")


def test_nested_include_equals_dotted(tmp_path):
    a = cells(tmp_path, "include:\n  - {optim: {name: sgd, lr: 0.1}}\n")
    b = cells(tmp_path, "include:\n  - {optim.name: sgd, optim.lr: 0.1}\n")
    assert [c.id for c in a] == [c.id for c in b]


def test_id_is_content_hash(tmp_path):
    one = cells(tmp_path, "matrix:\n  optim.lr: [1.0e-4]\n")[0]
    reordered = expansion.load(write(tmp_path / "r.yaml", """
name: other-name
matrix:
  optim.lr: [0.0001]
base:
  data: {recipe: arithmetic}
  model: {name: tiny-random-llama}
  tracking: {project: elsewhere}
"""))[1][0]
    assert one.id == reordered.id  # same resolved config (tracking does not count): same id
    changed = cells(tmp_path, "matrix:\n  optim.lr: [2.0e-4]\n")[0]
    assert changed.id != one.id
    assert len(one.id) == 10 and int(one.id, 16) >= 0


def test_a_later_key_at_its_default_keeps_earlier_ids():
    """train.group_by_length, train.loss_chunk, train.select, train.keep_best and train.compile came after cells
    were run: at their defaults a cell's id is what it was before."""
    from tunelab.core.config import CellConfig, content_id

    cell = CellConfig.model_validate({"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"}})
    before = cell.model_dump(mode="json", exclude={"tracking", "eval"})
    del before["train"]["group_by_length"], before["train"]["loss_chunk"]
    del before["train"]["select"], before["train"]["keep_best"]  # #23's (scores along training)
    del before["train"]["compile"]  # #25's
    assert cell.id() == content_id(before)
    for key, value in (("group_by_length", True), ("loss_chunk", 64), ("compile", True)):
        changed = cell.model_copy(update={"train": cell.train.model_copy(update={key: value})})
        assert changed.id() != cell.id()


def test_duplicate_cells_collapse(tmp_path):
    got = cells(tmp_path, "matrix:\n  peft.method: [none, lora]\ninclude:\n  - {peft.method: lora}\n")
    assert len(got) == 2


def test_single_cell_slug_is_matrix_name(tmp_path):
    (only,) = cells(tmp_path, "")
    assert only.slug == "m" and only.dirname == f"m-{only.id}"


@pytest.mark.parametrize("body, key", [
    ("matrix:\n  optim.name: []\n", "matrix.optim.name"),
    ("matrix:\n  optim.name: [adamw]\nexclude:\n  - {optim.name: sgd}\n", "exclude[0]"),
    ("matrix:\n  optim.name: [adamw]\nexclude:\n  - {peft.method: lora}\n", "exclude[0]"),
    ("matrix:\n  optim.lr: [0.1, fast]\n", "matrix.optim.lr[1]"),
    ("include:\n  - {train.stepz: 3}\n", "include[0].train.stepz"),
    ("seeds: [0]\nmatrix:\n  train.seed: [1, 2]\n", "seeds"),
])
def test_errors_name_the_key(tmp_path, body, key):
    with pytest.raises(UserError) as e:
        cells(tmp_path, body)
    assert "m.yaml" in str(e.value) and key in str(e.value)
