"""A search end to end on the tiny model: two method groups (full and LoRA), 3 trials each, successive halving
over rungs at steps 2 and 6, each group's cell as written as a baseline, the winners scored on the matrix's suite.

One module-scoped `exp run` is the reference. Against it: the trials are ordinary cells, pruned at their rung and
promoted ones going on from their rung with the losses of a twin run without pruning (the LoRA group's trials
train as one together-group: a promoted one goes on in memory, no process start, no checkpoint read); the Optuna
study records every value and decision; `exp tune status`, the leaderboard (a row per group), the report and
`exp compare` of two tuned groups; two runners on one search with one of them killed -9 mid-search (a node
lost) end with the same trial table and no trial run twice; and the same search recorded in a real PostgreSQL
server by two runners at once gives the same table again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import write
from postgres_server import server
from processes import attempts, kill_group, run_exp, start_exp, wait_for

from tunelab.core.files import read_json, read_jsonl
from tunelab.core.locks import is_locked, lock_holder
from tunelab.folders.cell import CellFolder

MATRIX = """name: ts
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  peft: {dropout: 0.1}
  train: {steps: 6, batch_size: 4, warmup_steps: 1}
  eval: {tasks: [val_loss, gsm8k_smoke], limit: 1, max_new_tokens: 4, val_batches: 2}
  tracking: {wandb: false}
matrix:
  peft.method: [none, lora]
tune:
  space: {optim.lr: {log_uniform: [1.0e-4, 1.0e-1]}}
  trials: 3
  pruner: halving
  min_steps: 2
  baseline: true
  storage: STORAGE
"""
# LoRA dropout draws from the RNG every step: a promoted trial that resumed without its RNG state would show.


def matrix_file(tmp_path, storage: str = "journal"):
    return write(tmp_path / "ts.yaml", MATRIX.replace("STORAGE", storage))


def status(runs) -> dict:
    got = run_exp("tune", "status", runs, "--json")
    assert got.returncode == 0, got.stderr
    studies = {s["group"]: s for s in json.loads(got.stdout)}
    for s in studies.values():  # JSON keys are strings: the rung steps back to numbers
        for t in s["trials"]:
            t["intermediate"] = {int(k): v for k, v in t["intermediate"].items()}
    return studies


def table(study: dict) -> tuple[list[dict], list[dict]]:
    """What the reproducibility claim is about: each trial's point, end and values (not where its folder is), and
    every rung decision (the values it ranked, the trials it promoted)."""
    keys = ("number", "bracket", "params", "state", "intermediate", "value", "reached", "pruned_at", "cell")
    return [{k: t[k] for k in keys} for t in study["trials"]], study["decisions"]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tune")
    path = matrix_file(tmp)
    done = run_exp("run", path, "--runs-dir", tmp / "runs", timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp, path, tmp / "runs" / "ts", status(tmp / "runs" / "ts")


def test_each_group_searched_with_the_same_budget_and_decided_by_its_rung(ref):
    _, _, runs, studies = ref
    assert set(studies) == {"none", "lora"}
    for s in studies.values():
        trials = s["trials"]
        assert [t["number"] for t in trials] == [0, 1, 2] and s["complete"] == 1 and s["pruned"] == 2
        assert s["steps"] == s["planned_steps"] == 3 * 2 + 1 * 4 and s["full_steps"] == 18
        (decision,) = s["decisions"]  # rung 1 (step 2): the lowest validation loss goes on, alone
        values = {n: v for n, v in decision["values"]}
        assert decision["step"] == 2 and decision["promoted"] == [min(values, key=lambda n: (values[n], n))]
        for t in trials:
            assert set(t["intermediate"]) == {2} and t["intermediate"][2] == values[t["number"]]
            promoted = t["number"] in decision["promoted"]
            assert t["state"] == ("complete" if promoted else "pruned") and t["reached"] == (6 if promoted else 2)
            d = Path(t["dir"])
            assert read_json(d / "cell.json")["id"] == t["cell"]  # a trial is a cell: its own folder
            steps = [r["step"] for r in read_jsonl(d / "train" / "metrics.jsonl")]
            assert steps == list(range(1, t["reached"] + 1))  # every step once, across the pause
            if not promoted:  # stopped at its rung; its checkpoint freed (it never trains again)
                assert CellFolder(d).status()["paused_at"] == 2 and not (d / "checkpoints").exists()
        assert s["best"]["value"] == trials[decision["promoted"][0]]["value"]
    # Both groups searched the same points: the sampler's seed, not the group, decides them.
    assert [t["params"] for t in studies["none"]["trials"]] == [t["params"] for t in studies["lora"]["trials"]]


def test_a_promoted_trial_continues_from_its_rung_with_the_losses_of_an_unpruned_twin(ref, tmp_path):
    """Full fine-tuning trials run alone: a promoted one resumes from its rung checkpoint in a new process. LoRA
    trials train together: a promoted one goes on in its group's process, without reading its checkpoint."""
    _, _, runs, studies = ref
    full = next(t for t in studies["none"]["trials"] if t["state"] == "complete")
    assert read_json(Path(full["dir"]) / "train" / "summary.json")["resumed_from"] == 2
    winner = next(t for t in studies["lora"]["trials"] if t["state"] == "complete")
    d = Path(winner["dir"])
    summary = read_json(d / "train" / "summary.json")
    assert summary["resumed_from"] is None and summary["continued_in_memory_from"] == [2]
    # Its group: the 3 trials and the LoRA group's default row (a plain cell of the same base), which trained to its
    # end beside the first rung's trials; the full fine-tuning default row cannot join and ran alone after.
    assert summary["together"]["members"] == 4
    for group, joined in (("lora", True), ("none", False)):
        row = next(c for c in read_json(runs / "cells.json") if c.get("tune", {}).get("role") == "default"
                   and c["tune"]["group"] == group)
        folder = next(p.parent for p in runs.glob("*/cell.json") if read_json(p)["id"] == row["id"])
        together = read_json(folder / "train" / "summary.json").get("together")
        assert (together is not None and together["group"] == summary["together"]["group"]) == joined, group
    twin = tmp_path / "twin"
    twin.mkdir()
    config = yaml.safe_load((d / "config.yaml").read_text())
    config["eval"]["tasks"] = ["val_loss"]
    (twin / "config.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNELAB_STOP")}
    done = subprocess.run([sys.executable, "-m", "tunelab.cell", str(twin)], check=False, capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ours = {r["step"]: r["loss"] for r in read_jsonl(d / "train" / "metrics.jsonl")}
    theirs = {r["step"]: r["loss"] for r in read_jsonl(twin / "train" / "metrics.jsonl")}
    assert ours == theirs and len(ours) == 6  # bit for bit: its schedule ran over all 6 steps either way
    assert read_json(twin / "train" / "summary.json")["val_loss"] == winner["value"]


def test_the_study_is_an_optuna_journal_with_every_value_and_decision(ref):
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    _, _, runs, studies = ref
    storage = JournalStorage(JournalFileBackend(str(runs / "tune" / "optuna.journal")))
    for s in studies.values():
        study = optuna.load_study(study_name=s["study"], storage=storage)
        states = [t.state.name for t in study.trials]
        assert states.count("COMPLETE") == 1 and states.count("PRUNED") == 2
        assert study.best_value == s["best"]["value"] and study.user_attrs["decisions"] == s["decisions"]


def test_the_leaderboard_has_a_row_per_group_with_its_tuned_config_budget_and_spread(ref):
    _, _, runs, studies = ref
    board = json.loads((runs / "leaderboard.json").read_text())
    rows = {r["cell"]: r for r in board["rows"]}
    assert set(rows) == {"none", "lora", "none-tuned", "lora-tuned"}  # the defaults and the tuned
    for group, s in studies.items():
        tuned, default = rows[f"{group}-tuned"], rows[group]
        lr = s["best"]["params"]["optim.lr"]
        assert tuned["tuning"] == "tuned (qmc, halving)" and tuned["tuned"] == f"optim.lr={lr:.4g}"
        assert tuned["search trials"] == "3 (2 pruned)" and tuned["search steps"] == "10 of 18"
        assert tuned["search best"] == tuned["search median"] == tuned["search worst"] == s["best"]["value"]
        assert default["tuning"] == "default" and default["search best"] is None
        # The winner was scored on the matrix's suite, on the winning trial's own weights.
        assert tuned["columns"]["gsm8k_smoke em_strict"]["n"] == 1
        assert tuned["columns"]["val_loss"]["mean"] == s["best"]["value"]


def test_tune_status_report_and_compare_of_two_tuned_groups(ref):
    _, _, runs, _ = ref
    shown = run_exp("tune", "status", runs, "--trials")
    assert shown.returncode == 0 and "best so far" in shown.stdout and "pruned" in shown.stdout
    page = (runs / "report.html").read_text()
    assert "<h2>Searches</h2>" in page and 'alt="objective against the searched value, per group"' in page
    assert "went on" in page  # the rung decisions' table
    both = run_exp("compare", runs / "none-tuned", runs / "lora-tuned", "--json")
    assert both.returncode == 0, both.stderr
    (pair,) = json.loads(both.stdout)
    assert pair["config_diff"]["peft.method"] == ["none", "lora"] and any(t["task"] == "gsm8k_smoke"
                                                                         for t in pair["tasks"])


def test_two_runners_one_killed_mid_search_end_with_the_same_trial_table(ref, tmp_path):
    """Runner A dies with its cell process (kill -9 of its process group: a node lost) while it holds a trial;
    runner B takes the trial over once the kernel frees its lock, resumes it and ends the search alone."""
    _, _, _, studies = ref
    path, runs = matrix_file(tmp_path), tmp_path / "runs"
    # The lora group's study (by its name): the same search as the reference's; its winner scored on validation loss
    # only, which its trial has already done (the suite's other task is the reference's to show).
    only = ("--only", "lora-*", "--set", "eval.tasks=[val_loss]")
    a = start_exp("run", path, "--runs-dir", runs, *only, log=tmp_path / "a.log")

    def held_by_a():
        for d in runs.joinpath("ts").glob("lora-t*"):
            if is_locked(d) and f"pid {a.pid} " in lock_holder(d) and CellFolder(d).status().get("state") == "running":
                return d
        return None

    # A first: a rung's trials train together, so whichever runner starts the rung holds all of them, and A must
    # hold one to be killed with it. B then starts beside it and waits for what A holds.
    wait_for(held_by_a, "runner A to run a trial", a)
    b = start_exp("run", path, "--runs-dir", runs, *only, log=tmp_path / "b.log", env={"PYTHONUNBUFFERED": "1"})
    wait_for(lambda: "tune" in (tmp_path / "b.log").read_text(), "runner B to start the search's stage", b)
    # Every trial A's together-group holds now, training or paused in memory (its lock A's).
    victims = {d for d in runs.joinpath("ts").glob("lora-t*") if is_locked(d) and f"pid {a.pid} " in lock_holder(d)}
    assert victims, "runner A ended its trials before B started"
    kill_group(a)
    assert b.wait(timeout=900) == 0, (tmp_path / "b.log").read_text()[-4000:]
    after = status(runs / "ts")["lora"]
    assert table(after) == table(studies["lora"])
    started = {}
    for t in after["trials"]:
        d = Path(t["dir"])
        # An attempt is a process taking a trial up: the trials train together, so a promoted trial goes on in its
        # group's process (no new attempt); each trial A held when killed is taken up once more (by B), the rest
        # ran where they started. Bounded either way: no trial ran twice (its metrics have each step once).
        starts = attempts(d)
        assert 1 <= starts <= 1 + (d in victims) + (t["state"] == "complete"), (d, starts)
        started[d] = starts
        assert [r["step"] for r in read_jsonl(d / "train" / "metrics.jsonl")] == list(range(1, t["reached"] + 1))
    again = run_exp("run", path, "--runs-dir", runs, *only)  # everything done: nothing runs again
    assert again.returncode == 0, again.stderr[-3000:]
    assert table(status(runs / "ts")["lora"]) == table(studies["lora"])
    assert {d: attempts(d) for d in started} == started


def test_a_postgresql_study_written_by_two_runners_at_once_holds_the_same_trials(ref, tmp_path):
    """The reference's cells copied to a fresh runs folder and two `exp run` at once with tune.storage on a real
    PostgreSQL server: nothing trains (every cell is there), both write the study, which ends with each trial
    once and the reference's table."""
    tmp, _, runs, studies = ref
    with server() as url:
        path = matrix_file(tmp_path, url)
        target = tmp_path / "runs" / "ts"
        shutil.copytree(runs, target, ignore=shutil.ignore_patterns("tune", "source.json"))  # cells, not their owner
        procs = [start_exp("run", path, "--runs-dir", tmp_path / "runs", log=tmp_path / f"{n}.log") for n in "ab"]
        for proc, n in zip(procs, "ab"):
            assert proc.wait(timeout=600) == 0, (tmp_path / f"{n}.log").read_text()[-3000:]
        got = status(target)
        assert read_json(target / "tune" / "studies.json")[0]["storage"] == url
        assert not (target / "tune" / "optuna.journal").exists()
        for group in ("none", "lora"):
            assert table(got[group]) == table(studies[group]) and got[group]["storage"] == url
