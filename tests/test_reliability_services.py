"""Services that are down or hung (on loopback only: a closed port, a socket that accepts and never answers):
every wait is bounded, the message says what was unreachable, W&B falls back to offline files and never fails
a cell, and an unreachable hub fails only the cells that need it, at once and saying so."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
from conftest import write
from processes import children, closed_port, run_exp, silent_server, start_exp, wait_for

from tunelab.core import hub_access
from tunelab.core.errors import UserError
from tunelab.core.files import read_json, read_jsonl
from tunelab.matrix import expansion

CELL = """name: NAME
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  train: {steps: STEPS, batch_size: 2}
  eval: {tasks: [val_loss], val_batches: 1}
  tracking: {wandb: WANDB}
"""


def matrix_file(tmp_path, name, steps=2, wandb="false", extra=""):
    text = CELL.replace("NAME", name).replace("STEPS", str(steps)).replace("WANDB", wandb) + extra
    path = write(tmp_path / f"{name}.yaml", text)
    return path, {(c.config.model.name, Path(c.config.data.recipe).stem): tmp_path / "runs" / name / c.dirname
                  for c in expansion.load(path)[1]}


def test_wandb_down_then_dying_never_fails_the_cell(tmp_path):
    """The W&B server hangs (online init times out: the run goes offline in the cell folder), then W&B's own
    process dies mid-training (tracking stops): the cell ends done, its log says both."""
    path, cells = matrix_file(tmp_path, "wb", steps=30, wandb="true")
    (cell,) = cells.values()
    with silent_server() as url:
        env = {"WANDB_MODE": "online", "WANDB_BASE_URL": url, "WANDB_API_KEY": "x" * 40, "WANDB_INIT_TIMEOUT": "3"}
        proc = start_exp("run", path, "--runs-dir", tmp_path / "runs", log=tmp_path / "run.log", env=env)
        log = cell / "cell.log"
        wait_for(lambda: log.is_file() and "logging offline" in log.read_text()
                 and read_jsonl(cell / "train" / "metrics.jsonl"), "training under an offline W&B run", proc)
        pid = read_json(cell / "status.json")["pid"]
        os.kill(pid, signal.SIGSTOP)  # hold the cell while its W&B process is killed
        try:
            core = [p for p, name in children(pid) if name.startswith("wandb-core")]
            assert core, children(pid)
            for p in core:
                os.kill(p, signal.SIGKILL)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert proc.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
    text = " ".join(log.read_text().split())
    assert "could not start an online run" in text and "logging offline to" in text and "wandb sync" in text
    assert "W&B tracking stops for this cell" in text
    assert read_json(cell / "status.json")["state"] == "done"
    assert [r["step"] for r in read_jsonl(cell / "train" / "metrics.jsonl")] == list(range(1, 31))
    assert list((cell / "wandb").glob("offline-run-*")), "no offline W&B run in the cell folder"


def test_an_unreachable_hub_fails_the_cells_that_need_it_at_once_and_says_why(tmp_path):
    """A hub model and a hub dataset behind a hub that never answers: each cell fails with its cause within
    the probe's timeout (without tunelab's bound, huggingface_hub waits forever on such a socket); a cell that
    needs no hub is unaffected."""
    hubdata = write(tmp_path / "hubdata.yaml", "sources:\n  - {hub: some-org/some-data}\n")
    path, cells = matrix_file(tmp_path, "hub", extra=f"include:\n  - {{model.name: some-org/some-model}}\n"
                              f"  - {{data.recipe: {hubdata}}}\n")
    local, hub_model, hub_data = (cells[k] for k in (("tiny-random-llama", "arithmetic"),
                                                      ("some-org/some-model", "arithmetic"),
                                                      ("tiny-random-llama", "hubdata")))
    with silent_server() as url:
        env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": url, "HF_HOME": str(tmp_path / "hf"),
               "TUNELAB_HUB_TIMEOUT": "2"}
        done = run_exp("run", path, "--runs-dir", tmp_path / "runs", env=env)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert read_json(local / "status.json")["state"] == "done"
    model = read_json(hub_model / "status.json")
    assert model["state"] == "failed" and "could not load model 'some-org/some-model'" in model["error"]
    assert f"the Hugging Face hub at {url} is unreachable (no answer within 2 s)" in model["error"]
    data = read_json(hub_data / "status.json")
    assert data["state"] == "failed" and "hubdata.yaml" in data["error"] and "some-org/some-data" in data["error"]
    assert f"the Hugging Face hub at {url} is unreachable (no answer within 2 s)" in data["error"]
    assert "UserError" in data["log_tail"][-1]  # the log's end is kept beside the cause


def test_the_probe_tells_a_closed_port_from_a_silent_one():
    assert "refused" in hub_access.unreachable(closed_port(), 2.0)
    with silent_server() as url:
        assert hub_access.unreachable(url, 1.0) == "no answer within 1 s"


def test_hub_requests_sent_without_a_timeout_end_at_the_bound(monkeypatch):
    """huggingface_hub 2.x passes timeout=None on some requests; the bound tunelab installs ends them."""
    import huggingface_hub
    from huggingface_hub.utils._http import default_client_factory

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the session would refuse at once
    hub_access._bound_requests(1.0)
    outcome: list = []
    try:
        with silent_server() as url:
            def ask():
                try:
                    huggingface_hub.get_session().get(f"{url}/api/models/some-org/some-model", timeout=None)
                    outcome.append("answered")
                except Exception as e:  # noqa: BLE001 - the kind is what the test looks at
                    outcome.append(type(e).__name__)

            asker = threading.Thread(target=ask, daemon=True)
            asker.start()
            asker.join(timeout=120)
        assert outcome and "Timeout" in outcome[0], outcome or "the request is still waiting"
    finally:
        huggingface_hub.set_client_factory(default_client_factory)


def test_env_values_are_checked(monkeypatch):
    monkeypatch.setenv(hub_access.TIMEOUT_ENV, "0")
    with pytest.raises(UserError, match="TUNELAB_HUB_TIMEOUT='0'"):
        hub_access.check_env()
    monkeypatch.setenv(hub_access.TIMEOUT_ENV, "2.5")
    assert hub_access.hub_timeout() == 2.5
    monkeypatch.setenv(hub_access.TIMEOUT_ENV, "")  # empty is unset, for every variable tunelab reads
    assert hub_access.hub_timeout() == hub_access.DEFAULT_TIMEOUT_S
    from tunelab.core.paths import cache_dir

    monkeypatch.setenv("TUNELAB_CACHE", "")  # not the current folder
    assert cache_dir() == Path.home() / ".cache" / "tunelab"
