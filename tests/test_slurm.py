"""`exp run --launcher slurm` end to end against a SLURM stand-in (tests/slurm/: sbatch, scontrol, srun and squeue
that run the batch script on this machine with SLURM's environment variables): the launcher section of the
matrix file becomes #SBATCH lines, a job array runs its cells, and a cell signalled mid-training (SIGUSR1 to
every process of the job, as SLURM's --signal does before the time limit) writes a checkpoint, marks itself
pending and requeues its job, which resumes from that checkpoint and ends with the uninterrupted losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, write

from tunelab.core.files import read_json, read_jsonl

STANDIN = REPO / "tests" / "slurm"
BASE = {"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic", "max_length": 96},
        "optim": {"lr": 1.0e-3}, "train": {"steps": 60, "batch_size": 4}, "eval": {"tasks": ["val_loss"],
        "val_batches": 1}, "tracking": {"wandb": False}}
LAUNCHER = {"partition": "gpu", "time": "01:00:00", "account": "proj42", "qos": "normal",
            "sbatch": ["--constraint=h100", "#SBATCH --exclusive"], "setup": ["echo setting up"]}
TIMEOUT = 300


@pytest.fixture
def slurm(monkeypatch, tmp_path):
    """The stand-in on PATH; its state folder."""
    from tunelab.models.loading import resolve

    resolve("tiny-random-llama")  # built once, before the job's processes look for it
    state = tmp_path / "slurm-state"
    monkeypatch.setenv("PATH", f"{STANDIN / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_STANDIN_DIR", str(state))
    monkeypatch.setenv("SLURM_STANDIN_PYTHON", sys.executable)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield state
    sys.path.insert(0, str(STANDIN))
    try:  # nothing a failed test started may outlive it
        import standin

        standin.STATE = state
        standin.cancel_all()
    finally:
        sys.path.remove(str(STANDIN))


def matrix(tmp_path, name: str, **extra) -> Path:
    return write(tmp_path / f"{name}.yaml", yaml.safe_dump({"name": name, "base": BASE, **extra}))


def wait_for(predicate, what: str, timeout: float = TIMEOUT):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def finished(state: Path, job: str) -> int | None:
    rc = state / f"job-{job}.rc"
    return int(rc.read_text()) if rc.is_file() else None


def test_launcher_section_becomes_sbatch_lines(cli, tmp_path):
    path = matrix(tmp_path, "m", launcher=LAUNCHER, matrix={"peft.method": ["none", "lora"]})
    code, _, err = cli("run", path, "--runs-dir", tmp_path / "runs", "--launcher", "slurm", "--dry-run",
                       "--qos", "high")
    assert code == 0, err
    scripts = sorted((tmp_path / "runs" / "m").glob("*/slurm.sbatch"))
    assert len(scripts) == 2  # one job per cell
    text = scripts[0].read_text()
    for line in ("--partition=gpu", "--time=01:00:00", "--account=proj42", "--qos=high", "--constraint=h100",
                 "--exclusive", "--requeue", "--signal=USR1@180"):
        assert f"#SBATCH {line}\n" in text
    assert "echo setting up\n" in text
    assert subprocess.run(["bash", "-n", str(scripts[0])], check=False).returncode == 0


def test_array_groups_cells_by_process_count(cli, tmp_path):
    path = matrix(tmp_path, "m", launcher={"array": True}, matrix={"parallel.dp": [1, 2], "optim.lr": [1e-3, 2e-3]})
    code, _, err = cli("run", path, "--runs-dir", tmp_path / "runs", "--launcher", "slurm", "--dry-run")
    assert code == 0, err
    scripts = sorted(p.name for p in (tmp_path / "runs" / "m").glob("slurm-array-*.sbatch"))
    assert scripts == ["slurm-array-1x1.sbatch", "slurm-array-2x1.sbatch"]
    assert "#SBATCH --array=0-1\n" in (tmp_path / "runs" / "m" / scripts[1]).read_text()


@pytest.mark.parametrize("launcher, needle", [
    ({"time": "4 hours"}, "launcher.time"),
    ({"time": "00:02:00", "signal_grace_s": 300}, "signal_grace_s 300 is not shorter"),
    ({"sbatch": ["exclusive"]}, "launcher.sbatch"),
    ({"partitoin": "gpu"}, "launcher.partitoin"),
])
def test_bad_launcher_section_is_refused_with_its_key(cli, tmp_path, launcher, needle):
    code, _, err = cli("plan", matrix(tmp_path, "m", launcher=launcher))
    assert code == 2 and needle in err.replace("\n", " "), err


def test_job_array_runs_its_cells(cli, slurm, tmp_path):
    base = {**BASE, "train": {"steps": 3, "batch_size": 4}}
    path = write(tmp_path / "a.yaml", yaml.safe_dump({"name": "a", "base": base, "launcher": {"array": True},
                                                     "matrix": {"optim.lr": [1e-3, 2e-3]}}))
    code, _, err = cli("run", path, "--runs-dir", tmp_path / "runs", "--launcher", "slurm")
    assert code == 0, err
    cells = sorted((tmp_path / "runs" / "a").glob("lr*"))
    jobs = [read_json(c / "status.json")["slurm_job"] for c in cells]
    assert jobs == ["1001_0", "1001_1"]
    for c in cells:
        wait_for(lambda c=c: read_json(c / "status.json").get("state") == "done", f"{c.name} done")


def test_preempted_cell_checkpoints_requeues_and_resumes_with_the_same_losses(cli, slurm, tmp_path):
    path = write(tmp_path / "p.yaml", yaml.safe_dump({"name": "p", "base": {**BASE, "parallel": {"dp": 2}},
                                                     "launcher": {"time": "00:30:00", "signal_grace_s": 60}}))
    code, _, err = cli("run", path, "--runs-dir", tmp_path / "runs", "--launcher", "slurm")
    assert code == 0, err
    cell = next(c.parent for c in (tmp_path / "runs" / "p").glob("*/cell.json"))
    job = read_json(cell / "status.json")["slurm_job"]
    metrics = cell / "train" / "metrics.jsonl"

    # As SLURM's --signal=USR1@60 does: every process of the job gets SIGUSR1 (the batch shell and torchrun's
    # agent ignore it; the two cell processes stop together at the next step boundary).
    wait_for(lambda: metrics.is_file() and len(read_jsonl(metrics)) >= 3, "step 3")
    assert subprocess.run(["scancel", "--signal=USR1", job], check=False).returncode == 0
    wait_for(lambda: finished(slurm, job) is not None, "the job to end")
    assert finished(slurm, job) == 0

    summary = read_json(cell / "train" / "summary.json")
    stopped_at = summary["resumed_from"]
    assert stopped_at is not None and 3 <= stopped_at < 60, summary
    log = (cell / f"slurm-{job}.log").read_text()
    assert f"stopped by SIGUSR1 after step {stopped_at}" in log and f"scontrol requeue {job}: exit 0" in log
    status = read_json(cell / "status.json")
    assert status["state"] == "done" and status["slurm_job"] == job
    records = read_jsonl(metrics)
    assert [r["step"] for r in records] == list(range(1, 61))  # each step once

    from tunelab.cell.stages import run_cell  # the uninterrupted run, on one process (layouts reproduce it)

    ref = tmp_path / "ref"
    write(ref / "config.yaml", yaml.safe_dump(BASE))
    run_cell(ref)
    expected = [r["loss"] for r in read_jsonl(ref / "train" / "metrics.jsonl")]
    assert [r["loss"] for r in records] == pytest.approx(expected, abs=1e-4)

    code, out, _ = cli("status", tmp_path / "runs" / "p", "--json")
    assert code == 0 and json.loads(out)[0]["slurm_job"] == job
    code, out, _ = cli("status", tmp_path / "runs" / "p")
    assert "slurm job" in out and job in out


@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM"])
def test_stop_signal_waits_for_the_step_boundary_inside_training_and_stops_at_once_outside(sig):
    import signal

    import torch

    from tunelab.machine import runtime

    saved = {s: signal.getsignal(s) for s in runtime.STOP_SIGNALS}
    try:
        runtime.catch_stop_signals()
        layout = runtime.Layout(device=torch.device("cpu"))
        assert not runtime.stop_agreed(layout)
        runtime.STOP.armed = True  # the training loop: a flag, read at the next step boundary
        os.kill(os.getpid(), getattr(signal, sig))
        assert runtime.STOP.signal == sig and runtime.stop_agreed(layout)
        runtime.STOP.armed = False  # elsewhere: stop now
        with pytest.raises(runtime.Preempted, match=sig):
            os.kill(os.getpid(), getattr(signal, sig))
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        runtime.STOP.installed, runtime.STOP.signal, runtime.STOP.armed = False, None, False


def test_bad_command_line_override_is_refused_before_anything_is_written(cli, tmp_path):
    code, _, err = cli("run", matrix(tmp_path, "m"), "--runs-dir", tmp_path / "runs", "--launcher", "slurm",
                       "--dry-run", "--time", "4 hours")
    assert code == 2 and "--time" in err and "no SLURM time limit" in err.replace("\n", " "), err
    assert not (tmp_path / "runs").exists()
