"""Hyperband with repeated studies on two workloads, end to end on the tiny model: two methods (full and LoRA)
tuned on two recipes (tune.workloads), each search run twice with independent sampler seeds (tune.studies: 2), 3
trials each in Hyperband's two brackets (steps 2/6: 2 -> 1, and one trial straight to 6).

One module-scoped `exp run` is the reference. Against it: every search's brackets, rungs and decisions; a tuned
row is the median over its studies' winners; the leaderboard's performance profile over the two workloads; what
each row cost, measured; `exp compare` of two tuned rows says how often one ranks above the other; and two runners
on LoRA's searches of one workload, one killed -9 while its trial trains (a node lost), end with the same trials and
decisions, every step logged once and the killed trial resumed from its last checkpoint, not restarted.

32 short cell runs for the reference, 9 for the two runners (their trials train together: a few minutes in CI,
which runs it); tests/test_tune_rankings.py checks the same
rules without training.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from conftest import write
from processes import attempts, kill_group, run_exp, start_exp, wait_for

from tunelab.core.files import read_json, read_jsonl
from tunelab.core.locks import is_locked, lock_holder
from tunelab.folders.cell import CellFolder
from tunelab.matrix.tune_section import Dist

MATRIX = """name: tw
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  peft: {dropout: 0.1}
  train: {steps: 6, batch_size: 4, warmup_steps: 1, save_every: 1}
  eval: {tasks: [val_loss], val_batches: 2}
  tracking: {wandb: false}
matrix:
  peft.method: [none, lora]
  data.recipe: [arithmetic, wordplay]
tune:
  space: {optim.lr: {log_uniform: [1.0e-4, 1.0e-1]}}
  trials: 3
  pruner: hyperband
  min_steps: 2
  studies: 2
  workloads: [data.recipe]
"""
# save_every 1: a trial killed mid-run has a checkpoint to resume from. LoRA dropout draws from the RNG every step.
GROUPS = [f"{m}-{w}" for m in ("none", "lora") for w in ("arithmetic", "wordplay")]
KEYS = ("number", "bracket", "params", "state", "intermediate", "value", "reached", "pruned_at", "cell")


def studies_of(runs: Path) -> dict[tuple[str, int], dict]:
    got = run_exp("tune", "status", runs, "--json")
    assert got.returncode == 0, got.stderr
    out = {}
    for s in json.loads(got.stdout):
        for t in s["trials"]:
            t["intermediate"] = {int(k): v for k, v in t["intermediate"].items()}
        out[(s["group"], s["study_index"])] = s
    return out


def table(study: dict) -> tuple[list[dict], list[dict]]:
    """What the reproducibility claim is about: each trial's point, end and values, and every rung decision."""
    return [{k: t[k] for k in KEYS} for t in study["trials"]], study["decisions"]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tw")
    path = write(tmp / "tw.yaml", MATRIX)
    done = run_exp("run", path, "--runs-dir", tmp / "runs", timeout=2400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return path, tmp / "runs" / "tw", studies_of(tmp / "runs" / "tw"), done


def test_each_method_is_searched_on_each_workload_in_two_hyperband_studies(ref):
    _, runs, studies, _ = ref
    assert set(studies) == {(g, s) for g in GROUPS for s in (0, 1)}
    for s in studies.values():
        trials = s["trials"]
        assert [t["bracket"] for t in trials] == [0, 0, 1]  # Hyperband: steps 2/6 (2 -> 1), and steps 6 (1)
        (decision,) = s["decisions"]  # bracket 0, rung step 2: the lower validation loss goes on
        values = dict(decision["values"])
        assert decision["step"] == 2 and decision["promoted"] == [min(values, key=lambda n: (values[n], n))]
        assert [t["reached"] for t in trials] == [6 if t["number"] in decision["promoted"] else 2 for t in trials[:2]] \
            + [6]
        assert s["steps"] == s["planned_steps"] == 2 * 2 + 1 * 4 + 6
        assert s["best"]["value"] == min(t["value"] for t in trials if t["state"] == "complete")
    for g in GROUPS:  # two studies: other points; one study of two methods: the same points (paired)
        assert studies[(g, 0)]["trials"][0]["params"] != studies[(g, 1)]["trials"][0]["params"]
        for k in (0, 1):
            assert [t["params"] for t in studies[(g, k)]["trials"]] == \
                [t["params"] for t in studies[(GROUPS[0], k)]["trials"]]


def test_a_tuned_row_is_the_median_over_its_studies_and_the_methods_are_profiled_over_the_workloads(ref):
    _, runs, studies, done = ref
    board = json.loads((runs / "leaderboard.json").read_text())
    rows = {r["cell"]: r for r in board["rows"]}
    assert set(rows) == {f"{g}-tuned" for g in GROUPS}
    for g in GROUPS:
        winners = [studies[(g, k)]["best"]["value"] for k in (0, 1)]
        st = rows[f"{g}-tuned"]["columns"]["val_loss"]  # each winner scored on the suite: its trial's own weights
        assert (st["mean"], st["low"], st["high"], st["studies"]) == (
            statistics.median(winners), min(winners), max(winners), 2)
        assert rows[f"{g}-tuned"]["search trials"] == "6 (2 pruned) in 2 studies"
        cost = rows[f"{g}-tuned"]["search cost"]  # measured from the cells' runs
        assert cost.endswith(")") and "CPU-h (search " in cost and float(cost.split()[0]) > 0
        space = {"optim.lr": Dist.model_validate({"log_uniform": [1.0e-4, 1.0e-1]})}
        edges = [k for k in (0, 1) if space["optim.lr"].edge(studies[(g, k)]["best"]["params"]["optim.lr"])]
        shown = rows[f"{g}-tuned"]["search edge"]
        assert (shown is not None) == bool(edges) and (not edges or f"in {len(edges)} of 2 studies" in shown)
        assert all(f"search {g} (study {k + 1} of 2): best at the" in done.stderr for k in edges)  # exp run says it
    value = {g: rows[f"{g}-tuned"]["columns"]["val_loss"]["mean"] for g in GROUPS}
    prof = {p["method"]: p for p in board["profiles"]}
    assert set(prof) == {"none-tuned", "lora-tuned"}
    for w in ("arithmetic", "wordplay"):
        best = min(value[f"{m}-{w}"] for m in ("none", "lora"))
        for m in ("none", "lora"):
            assert prof[f"{m}-tuned"]["ratios"][w] == pytest.approx(value[f"{m}-{w}"] / best)
    for p in prof.values():
        assert p["workloads"] == 2 and p["score"] == pytest.approx(
            sum(max(0, 4 - r) for r in p["ratios"].values()) / 3 / 2)
    page = (runs / "report.html").read_text()
    for section in ("Across workloads", "What each search cost", "How often one method ranks above another"):
        assert section in page


def test_compare_of_two_tuned_rows_says_how_often_one_ranks_above_the_other(ref):
    _, runs, studies, _ = ref
    both = run_exp("compare", runs / "none-arithmetic-tuned", runs / "lora-arithmetic-tuned", "--json")
    assert both.returncode == 0, both.stderr
    pairs = json.loads(both.stdout)
    assert len(pairs) == 2  # study by study (one seed each)
    (r,) = pairs[0]["rankings"]
    assert r["task"] == "val_loss" and (r["studies"], r["seeds"]) == (2, 1) and r["resamples"] == 10_000
    # Two studies, one seed: the draws are (0, 0) and (1, 1) a quarter of the time each, else both (a median of two
    # is their mean); A ranks above B where its validation loss is lower, a tie counts half.
    a, b = ([studies[(g, k)]["best"]["value"] for k in (0, 1)] for g in ("none-arithmetic", "lora-arithmetic"))

    def wins(x: float, y: float) -> float:
        return 1.0 if x < y else 0.5 if x == y else 0.0

    exact = wins(a[0], b[0]) / 4 + wins(a[1], b[1]) / 4 + wins(sum(a) / 2, sum(b) / 2) / 2
    assert abs(r["above"] - exact) <= 4 * (exact * (1 - exact) / 10_000) ** 0.5
    assert r["a"] == statistics.median(a) and r["b"] == statistics.median(b)
    again = run_exp("compare", runs / "none-arithmetic-tuned", runs / "lora-arithmetic-tuned", "--json")
    assert json.loads(again.stdout)[0]["rankings"] == [r]  # seeded: the same share
    shown = run_exp("tune", "status", runs)
    assert shown.returncode == 0
    space = Dist.model_validate({"log_uniform": [1.0e-4, 1.0e-1]})
    for (g, k), s in studies.items():  # each study whose best sits at an edge of the space says so
        said = f"{g} (study {k + 1} of 2): best at the"
        assert (said in shown.stdout) == bool(space.edge(s["best"]["params"]["optim.lr"])), shown.stdout


def test_two_runners_one_killed_mid_hyperband_studies_end_with_the_same_trials_and_decisions(ref, tmp_path):
    """Runner A dies with its cell process (kill -9 of its process group) while it trains a trial of Hyperband's
    second bracket (straight to 6 steps) past a checkpoint; runner B takes the trial over once the kernel frees its
    lock and resumes it from that checkpoint."""
    path, _, studies, _ = ref
    runs = tmp_path / "runs"
    # Its two studies: as many second-bracket trials as runners. Each trial in its own process (--together off):
    # a rung's trials that train together go to whichever runner starts first (tests/test_tune_search.py kills a
    # runner holding a together-group's trials).
    only = ("--only", "lora-arithmetic*", "--together", "off")
    a = start_exp("run", path, "--runs-dir", runs, *only, log=tmp_path / "a.log")
    b = start_exp("run", path, "--runs-dir", runs, *only, log=tmp_path / "b.log")

    def training_in_a():
        for d in runs.joinpath("tw").glob("lora-arithmetic-*-t02-*"):
            if not is_locked(d) or f"pid {a.pid} " not in lock_holder(d):
                continue
            steps = [r["step"] for r in read_jsonl(d / "train" / "metrics.jsonl")]
            if steps and steps[-1] <= 4 and (d / "checkpoints" / f"step-{steps[-1]}").is_dir():
                return d, steps[-1]
        return None

    victim, at = wait_for(training_in_a, "runner A to train a trial of the second bracket past a checkpoint", a)
    kill_group(a)
    assert b.wait(timeout=1200) == 0, (tmp_path / "b.log").read_text()[-4000:]
    after = studies_of(runs / "tw")
    for k in (0, 1):
        assert table(after[("lora-arithmetic", k)]) == table(studies[("lora-arithmetic", k)])
    for s in (after[("lora-arithmetic", k)] for k in (0, 1)):
        for t in s["trials"]:
            d = Path(t["dir"])
            runs_needed = 2 if t["bracket"] == 0 and t["state"] == "complete" else 1
            assert attempts(d) == runs_needed + (d == victim), (d, attempts(d))
            assert [r["step"] for r in read_jsonl(d / "train" / "metrics.jsonl")] == list(range(1, t["reached"] + 1))
    # Resumed, not restarted: B's run began at the checkpoint A left (or a later one), and only ended runs count.
    resumed = read_json(victim / "train" / "summary.json")["resumed_from"]
    assert resumed is not None and at <= resumed < 6
    assert [x["state"] for x in CellFolder(victim).attempts()] == ["done"]  # A's killed run left no end
