"""W&B (offline here): a cell resumed from a checkpoint continues its run; a fresh start gets a new one."""

from __future__ import annotations

import pytest

from tunelab.core.config import CellConfig
from tunelab.report.tracking import RUN_ID_FILE, Tracker


@pytest.fixture
def cfg(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    return CellConfig.model_validate({"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"}})


def open_run(cfg, run_dir, resuming: bool) -> str:
    t = Tracker(cfg, run_dir, group="g", name="n", config={}, tags=[], resuming=resuming)
    t.log({"train/loss": 1.0}, step=1)
    run_id = t.run.id
    t.finish()
    return run_id


def test_resumed_cell_continues_its_run(cfg, tmp_path):
    first = open_run(cfg, tmp_path, resuming=False)
    assert (tmp_path / RUN_ID_FILE).read_text().strip() == first
    assert open_run(cfg, tmp_path, resuming=True) == first


def test_cell_that_starts_over_gets_a_new_run(cfg, tmp_path):
    first = open_run(cfg, tmp_path, resuming=False)
    second = open_run(cfg, tmp_path, resuming=False)
    assert second != first
    assert (tmp_path / RUN_ID_FILE).read_text().strip() == second
    assert open_run(cfg, tmp_path / "other", resuming=True) not in (first, second)  # nothing to resume there
