"""Exact resume after a real SIGKILL: of the cell process (the resumed run's per-step losses equal those of an
uninterrupted run, and metrics.jsonl holds every step once), and of `exp run` with its cells, once while a cell
trains and once while it evaluates (the finished cell is kept, the evaluation is redone, never reported
complete, and the numbers equal those of an uninterrupted `exp run`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml

from tunelab.core.files import read_json, read_jsonl
from tunelab.folders.cell import CellFolder

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
    from tunelab.cell.stages import run_cell

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


# ---- the runner killed with its cells, in training and in evaluation ----

MATRIX = """name: killme
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  peft: {method: lora, dropout: 0.1}
  optim: {lr: 1.0e-3}
  train: {steps: 30, batch_size: 2, warmup_steps: 2, save_every: 10}
  eval: {tasks: [val_loss, humaneval], val_batches: 2, limit: 2, max_new_tokens: 8}
  tracking: {wandb: false}
matrix:
  train.steps: [3, 30]
"""


def last_step(cell_dir) -> int:
    return max((r["step"] for r in read_jsonl(cell_dir / "train" / "metrics.jsonl")), default=0)


def results_of(cell_dir) -> dict:
    found = list((cell_dir / "eval").glob("*/results.json"))
    return (read_json(found[0]) or {}) if found else {}


def snapshot(cell_dir) -> dict:
    return {p: p.stat().st_mtime_ns for p in cell_dir.rglob("*") if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def killed_matrix(tmp_path_factory):
    """The second cell run to its end (the reference); then the matrix with its first cell done: `exp run`
    killed with its cells (SIGKILL to the process group) while the second cell trains, run again and killed
    while that cell evaluates, then run to the end."""
    from conftest import write
    from processes import kill_group, run_exp, start_exp, wait_for

    from tunelab.cell.stages import run_cell
    from tunelab.matrix import expansion
    from tunelab.run import runner

    tmp = tmp_path_factory.mktemp("killme")
    path = write(tmp / "killme.yaml", MATRIX)
    spec, cells = expansion.load(path)
    first, second = (c.dirname for c in cells)
    ref = tmp / "ref" / second  # the second cell uninterrupted, in this process, as the runner prepares it
    runs = tmp / "runs"
    c1, c2 = runs / "killme" / first, runs / "killme" / second
    for cell, folder in ((cells[1], ref), (cells[0], c1)):  # and the first cell finished by an earlier run
        runner.prepare(CellFolder(folder), cell, spec.name)
        run_cell(folder)
    seen: dict = {}

    proc = start_exp("run", path, "--runs-dir", runs, log=tmp / "run1.log")
    wait_for(lambda: last_step(c2) >= 12 and (c2 / "checkpoints" / "step-10").is_dir(),
             "the second cell trained past its first checkpoint", proc)
    kill_group(proc)
    seen["train_kill"] = {"step": last_step(c2), "status": read_json(c2 / "status.json"),
                          "final": (c2 / "final").exists(),
                          "exp_status": run_exp("status", runs / "killme", "--json"), "c1": snapshot(c1)}

    proc = start_exp("run", path, "--runs-dir", runs, log=tmp / "run2.log")
    wait_for(lambda: "val_loss" in results_of(c2).get("tasks", {}), "the second cell's first eval task", proc)
    kill_group(proc)
    seen["eval_kill"] = {"results": results_of(c2), "status": read_json(c2 / "status.json"),
                         "exp_status": run_exp("status", runs / "killme", "--json"),
                         "log": (tmp / "run2.log").read_text()}

    last = run_exp("run", path, "--runs-dir", runs)
    return tmp, c1, c2, seen, last


def _state(exp_status, cell_dir) -> str:
    return next(r["state"] for r in json.loads(exp_status.stdout) if r["dir"] == str(cell_dir))


def test_a_killed_runner_leaves_a_cell_that_says_running_under_a_free_lock(killed_matrix):
    _, c1, c2, seen, _ = killed_matrix
    kill = seen["train_kill"]
    assert kill["status"]["state"] == "running" and not kill["status"].get("trained")
    assert kill["step"] < 30 and not kill["final"]
    assert _state(kill["exp_status"], c2) == "interrupted" and _state(kill["exp_status"], c1) == "done"
    ev = seen["eval_kill"]
    assert ev["status"]["state"] == "running" and ev["status"]["trained"] is True  # killed while evaluating
    assert ev["results"]["complete"] is False and list(ev["results"]["tasks"]) == ["val_loss"]
    assert _state(ev["exp_status"], c2) == "interrupted"
    assert "done, skipped" in ev["log"]  # the finished cell is kept


def test_the_next_run_resumes_and_ends_with_the_numbers_of_an_uninterrupted_run(killed_matrix):
    tmp, c1, c2, seen, last = killed_matrix

    assert last.returncode == 0, last.stderr[-3000:]
    assert snapshot(c1) == seen["train_kill"]["c1"]  # the finished cell was never touched again
    ref = tmp / "ref" / c2.name
    resumed_from = read_json(c2 / "train" / "summary.json")["resumed_from"]
    assert resumed_from is not None and resumed_from % 10 == 0 and resumed_from <= seen["train_kill"]["step"]
    a, b = read_jsonl(ref / "train" / "metrics.jsonl"), read_jsonl(c2 / "train" / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 31))
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], abs=1e-6), ra["step"]
    status = read_json(c2 / "status.json")
    assert status["state"] == "done" and status["evaluating_only"] is True  # the evaluation alone was redone
    res, ref_res = results_of(c2), results_of(ref)
    assert res["complete"] is True and CellFolder(c2).eval_done(eval_id(c2))
    for task in ("val_loss", "humaneval"):
        assert res["tasks"][task]["value"] == pytest.approx(ref_res["tasks"][task]["value"], abs=1e-6), task
    completions = [[r["completion"] for r in read_jsonl(next((d / "eval").glob("*/samples.jsonl")))]
                   for d in (ref, c2)]
    assert completions[0] == completions[1] and len(completions[0]) == 2  # the same programs, generated again
    assert (c2.parent / "leaderboard.csv").read_text().count(",done,") == 2


def eval_id(cell_dir) -> str:
    (only,) = (p.name for p in (cell_dir / "eval").iterdir())
    return only
