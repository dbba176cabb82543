"""Exact resume after a real SIGKILL of the cell process: the resumed run's per-step losses equal those
of an uninterrupted run, and metrics.jsonl holds every step once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml

from tunelab.store import read_json, read_jsonl

STEPS, SAVE_EVERY, EVAL_EVERY = 60, 10, 15
CONFIG = {
    "model": {"name": "tiny-random-llama"},
    "data": {"recipe": "arithmetic", "max_length": 48},
    # LoRA dropout draws from the torch RNG every step, so a resume that lost the RNG state would show.
    "peft": {"method": "lora", "dropout": 0.1},
    "optim": {"lr": 1e-3},
    "train": {"steps": STEPS, "batch_size": 4, "grad_accum": 2, "warmup_steps": 5, "save_every": SAVE_EVERY,
              "eval_every": EVAL_EVERY},
    "eval": {"tasks": ["val_loss"], "val_batches": 2, "batch_size": 8},
    "tracking": {"wandb": False},
}


def start_cell(run_dir):
    return subprocess.Popen([sys.executable, "-m", "tunelab.cell", str(run_dir)], stdout=subprocess.PIPE,
                            stderr=(run_dir / "cell.log").open("a"), text=True, env={**os.environ})


def prepare(run_dir):
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    return run_dir


def run_to_end(run_dir):
    proc = start_cell(run_dir)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, (run_dir / "cell.log").read_text()[-3000:]
    return [json.loads(line) for line in out.splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    whole = prepare(tmp / "whole")
    from tunelab.cell import run_cell

    run_cell(whole)  # the uninterrupted reference, in this process: same stages, same seeds

    killed = prepare(tmp / "killed")
    proc = start_cell(killed)
    killed_at = None
    for line in proc.stdout:
        event = json.loads(line)
        if event.get("stage") == "train" and event["step"] >= SAVE_EVERY + 3:
            steps = [r["step"] for r in read_jsonl(killed / "train" / "metrics.jsonl")]
            if (killed / "checkpoints" / f"step-{SAVE_EVERY}").is_dir() and max(steps) > SAVE_EVERY:
                os.kill(proc.pid, signal.SIGKILL)
                killed_at = max(steps)
                break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL and killed_at is not None, "the cell ended before it was killed"
    assert read_json(killed / "status.json")["state"] == "running"  # it died without a word
    before = read_jsonl(killed / "train" / "metrics.jsonl")
    events = run_to_end(killed)
    return whole, killed, killed_at, before, events


def test_killed_run_resumes_from_its_latest_checkpoint(runs):
    _, killed, killed_at, before, events = runs
    resumed_from = read_json(killed / "train" / "summary.json")["resumed_from"]
    assert resumed_from is not None and resumed_from % SAVE_EVERY == 0 and resumed_from < killed_at
    assert max(r["step"] for r in before) > resumed_from  # steps past the checkpoint were lost and redone
    assert [e["step"] for e in events if e.get("stage") == "resume"] == [resumed_from]
    assert read_json(killed / "status.json")["state"] == "done"
    assert (killed / "final" / "adapter_config.json").is_file()


def test_resumed_losses_equal_the_uninterrupted_run(runs):
    whole, killed, *_ = runs
    a = read_jsonl(whole / "train" / "metrics.jsonl")
    b = read_jsonl(killed / "train" / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))  # no step twice, none missing
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], abs=1e-6), ra["step"]
        assert rb["lr"] == pytest.approx(ra["lr"], abs=1e-12), ra["step"]
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], abs=1e-5), ra["step"]
        assert rb.get("val_loss") == pytest.approx(ra.get("val_loss"), abs=1e-6), ra["step"]
    assert sum("val_loss" in r for r in b) == STEPS // EVAL_EVERY
    sa, sb = read_json(whole / "train" / "summary.json"), read_json(killed / "train" / "summary.json")
    assert sb["val_loss"] == pytest.approx(sa["val_loss"], abs=1e-6)
