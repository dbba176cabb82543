"""Rankings a search can defend, without training: repeated studies planned, the edge rule of a search space, the
workloads a method is tuned on, any task of the eval section as the objective, the statistics (a performance
profile and its AlgoPerf score against a hand-computed case and scipy; the bootstrap of studies and seeds against
exact enumeration), how a tuned row of several studies reads in every leaderboard format, and what a row cost.

The same end to end, on the tiny model with two runners and a kill -9, is tests/test_tune_studies.py."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import write

from tunelab.folders.cell import CellFolder
from tunelab.matrix import expansion
from tunelab.matrix.tune_section import Dist
from tunelab.report import cost, profiles, ranking
from tunelab.tune import plan as tune_plan

MATRIX = """name: tr
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  train: {steps: 6, batch_size: 2}
  eval: {tasks: [val_loss]}
  tracking: {wandb: false}
matrix:
  data.recipe: [arithmetic, wordplay]
include:
  - {optim.name: adamw}
  - {optim.name: lion}
  - {optim.name: sgd, tune: false}
seeds: [0, 1]
tune:
  space: {optim.lr: {log_uniform: [1.0e-5, 1.0e-2]}}
  trials: 3
  studies: 3
  workloads: [data.recipe]
  baseline: true
"""


def groups_of(tmp_path, text=MATRIX, sets=None):
    path = write(tmp_path / "tr.yaml", text)
    spec, _ = expansion.load(path, dict(sets or {}))
    return tune_plan.groups(spec, path, sets or {})


# -- repeated studies and workloads, planned ---------------------------------------------------------------------

def test_each_method_is_searched_on_every_workload_in_independent_studies(tmp_path):
    groups = groups_of(tmp_path)
    # The workload axis crosses the include entries: each optimizer on each recipe; sgd (tune: false) is a cell.
    assert [(g.slug, g.study_index) for g in groups] == [
        (f"{o}-{w}", s) for o in ("adamw", "lion") for w in ("arithmetic", "wordplay") for s in range(3)]
    assert [g.spec.seed for g in groups[:3]] == [0, 1, 2]  # study s samples with seed tune.seed + s
    assert len({g.study for g in groups}) == len(groups)
    # Study 0 is the search a single study runs: the same name, so raising `studies` keeps it.
    one = groups_of(tmp_path, MATRIX.replace("studies: 3", "studies: 1"))
    assert [g.study for g in one] == [g.study for g in groups if g.study_index == 0]
    # Study s of two methods samples the same points: a paired design, study by study.
    from tunelab.tune.search import Search

    first = {}
    for g in groups:
        s = Search(g, tmp_path / "runs")
        s.start_bracket(0)
        first.setdefault(g.study_index, set()).add(tuple(t.view.params["optim.lr"] for t in s.trials))
    assert all(len(points) == 1 for points in first.values()) and len({*map(frozenset, first.values())}) == 3
    spec, cells = expansion.load(tmp_path / "tr.yaml")
    assert sorted(c.slug for c in cells) == sorted(f"{o}-{w}-s{s}" for o in ("adamw", "lion", "sgd")
                                                   for w in ("arithmetic", "wordplay") for s in (0, 1))


def test_the_plan_shows_a_groups_studies_together_with_their_budget(cli, tmp_path):
    path = write(tmp_path / "tr.yaml", MATRIX)
    code, out, err = cli("plan", path, "--json")
    assert code == 0, err
    rows = {g["group"]: g for g in json.loads(out)["groups"]}
    assert list(rows) == ["adamw-arithmetic", "adamw-wordplay", "lion-arithmetic", "lion-wordplay"]
    g = rows["adamw-arithmetic"]
    assert g["studies"] == 3 and len(g["study_names"]) == 3 and g["workloads"] == ["data.recipe"]
    assert g["search_steps"] == 3 * 3 * 6 and g["retrain_steps"] == 3 * 1 * 6  # each study's winner, seed 1
    code, out, _ = cli("plan", path)
    assert code == 0 and "4 method groups searched with the same budget, 3 studies each" in " ".join(out.split())


def test_set_makes_an_axis_of_a_stand_in(tmp_path):
    text = MATRIX.replace("matrix:\n  data.recipe: [arithmetic, wordplay]\n", "")
    text = text.replace("  workloads: [data.recipe]\n", "")
    sets = {"matrix.data.recipe": ["arithmetic", "wordplay"], "tune.workloads": ["data.recipe"]}
    got = groups_of(tmp_path, text, sets)
    assert {g.slug for g in got} == {f"{o}-{w}" for o in ("adamw", "lion") for w in ("arithmetic", "wordplay")}


BAD = {
    "a workload that is no axis": ("  workloads: [model.name]\n", "tune.workloads[0]", "not a matrix axis"),
    "a searched workload": ("  workloads: [optim.lr]\n", "tune", "is searched and named a workload axis"),
    "no studies": ("  studies: 0\n", "tune.studies", "greater than 0"),
    "studies in one group only": ("", "include[0].tune.studies", "studies 2 differs from tune.studies 1"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_studies_and_workloads_exit_2_naming_the_file_and_key(cli, tmp_path, case):
    lines, key, message = BAD[case]
    text = f"""name: bad
base: {{model: {{name: tiny-random-llama}}, data: {{recipe: arithmetic}}, train: {{steps: 8}}}}
matrix: {{data.recipe: [arithmetic, wordplay]}}
include:
  - {{optim.name: adamw{', tune: {studies: 2}' if not lines else ''}}}
  - {{optim.name: lion}}
tune:
  space: {{optim.lr: {{log_uniform: [1.0e-6, 1.0e-3]}}}}
  trials: 2
{lines}"""
    path = write(tmp_path / "bad.yaml", text)
    code, _, err = cli("run", path, "--runs-dir", tmp_path / "runs")
    text = " ".join(err.split())
    assert code == 2 and f"{path}: {key}" in text and message in text, text
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


# -- any task of the eval section as the objective -----------------------------------------------------------------

def _local_tasks(folder: Path) -> Path:
    """Two local lm-eval tasks on the same items: one scores its test split, one its validation split."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "mc.jsonl"
    data.write_text("".join(json.dumps({"q": q, "choices": ["yes", "no"], "label": i % 2}) + "\n"
                            for i, q in enumerate(["Is fire hot?", "Is ice hot?", "Is water wet?"])))
    body = ("dataset_path: json\ndataset_kwargs: {{data_files: {{{split}: {data}}}}}\n{split}_split: {split}\n"
            "output_type: multiple_choice\ndoc_to_text: \"{{{{q}}}}\"\ndoc_to_target: label\ndoc_to_choice: choices\n"
            "metric_list:\n  - {{metric: acc, aggregation: mean, higher_is_better: true}}\n"
            "metadata: {{version: 1.0}}\n")
    for name, split in (("tl_test", "test"), ("tl_val", "validation")):
        (folder / f"{name}.yaml").write_text(f"task: {name}\n" + body.format(split=split, data=data))
    return folder


def test_the_objective_may_be_any_task_of_the_eval_section_and_its_split_decides(cli, tmp_path):
    folder = _local_tasks(tmp_path / "tasks")
    text = MATRIX.replace("tasks: [val_loss]", f"tasks: [val_loss, tl_val, tl_test], include_path: {folder}")
    ok = write(tmp_path / "ok.yaml", text.replace("  baseline: true\n", "  baseline: true\n  metric: tl_val\n"))
    code, out, err = cli("plan", ok, "--json")
    assert code == 0, err
    assert {(g["metric"], g["direction"]) for g in json.loads(out)["groups"]} == {("tl_val", "maximize")}
    test = write(tmp_path / "t.yaml", text.replace("  baseline: true\n", "  baseline: true\n  metric: tl_test\n"))
    code, _, err = cli("plan", test)
    assert code == 2 and f"{test}: tune.metric" in err and "scored on its test set" in " ".join(err.split())
    allowed = text.replace("  baseline: true\n", "  baseline: true\n  metric: tl_test\n  allow_test_selection: true\n")
    groups = groups_of(tmp_path, allowed)
    assert {g.on_test for g in groups} == {True}
    missing = write(tmp_path / "m.yaml", text.replace("  baseline: true\n", "  baseline: true\n  metric: tl_other\n"))
    code, _, err = cli("plan", missing)
    assert code == 2 and "no task produces 'tl_other'" in err and "tl_val" in err


# -- the edges of a search space -----------------------------------------------------------------------------------

def test_the_edge_rule_outer_tenth_in_log_space_and_the_ends_of_ordered_values():
    log = Dist.model_validate({"log_uniform": [1e-6, 1e-2]})  # four decades: a tenth is 0.4 of one
    assert log.edge(1e-6 * 10 ** 0.39) == "lower" and log.edge(1e-6 * 10 ** 0.41) is None
    assert log.edge(1e-2 / 10 ** 0.39) == "upper" and log.edge(1e-3) is None
    assert log.edge_zones()["upper"] == pytest.approx([1e-2 / 10 ** 0.4, 1e-2])
    lin = Dist.model_validate({"uniform": [0.0, 1.0]})
    assert (lin.edge(0.05), lin.edge(0.5), lin.edge(0.95)) == ("lower", None, "upper")
    ints = Dist.model_validate({"int": [4, 32]})
    assert (ints.edge(4), ints.edge(5), ints.edge(31), ints.edge(32)) == ("lower", None, None, "upper")
    ordered = Dist.model_validate({"choice": [16, 4, 8]})  # numbers: their order, not the order written
    assert (ordered.edge(4), ordered.edge(8), ordered.edge(16)) == ("lower", None, "upper")
    words = Dist.model_validate({"choice": ["lora", "dora"]})  # no order, no edge
    assert words.edge("lora") is None and words.edge_zones() == {}


# -- the statistics ------------------------------------------------------------------------------------------------

def test_a_performance_profile_and_its_score_by_hand_and_against_scipy():
    from scipy import integrate

    # Losses (lower is better) of three methods on four workloads; B has no score on w4.
    results = {"A": {"w1": 1.0, "w2": 2.0, "w3": 3.0, "w4": 1.0},
               "B": {"w1": 2.0, "w2": 1.0, "w3": 9.0, "w4": None},
               "C": {"w1": 1.5, "w2": 4.0, "w3": 1.0, "w4": 0.5}}
    got = {p.method: p for p in profiles.profiles(results, higher_is_better=False)}
    # By hand: the best per workload is 1, 1, 1, 0.5, so the ratios are
    assert got["A"].ratios == {"w1": 1.0, "w2": 2.0, "w3": 3.0, "w4": 2.0}
    assert got["B"].ratios == {"w1": 2.0, "w2": 1.0, "w3": 9.0, "w4": math.inf}
    assert got["C"].ratios == {"w1": 1.5, "w2": 4.0, "w3": 1.0, "w4": 1.0}
    assert [got["A"].rho(t) for t in (1.0, 1.99, 2.0, 3.0)] == [0.25, 0.25, 0.75, 1.0]
    # Area from 1 to 4 over 3: A (3 + 2 + 1 + 2) / 3 / 4, B (2 + 3) / 3 / 4, C (2.5 + 0 + 3 + 3) / 3 / 4
    assert got["A"].score() == pytest.approx(8 / 12) and got["B"].score() == pytest.approx(5 / 12)
    assert got["C"].score() == pytest.approx(8.5 / 12)
    assert [p.method for p in profiles.profiles(results, False)] == ["C", "A", "B"]
    for p in got.values():  # the closed form is the integral of the step function
        breaks = sorted(r for r in p.ratios.values() if 1 < r < 4)
        area, _ = integrate.quad(p.rho, 1, 4, points=breaks or None, limit=200)
        assert p.score() == pytest.approx(area / 3, abs=1e-9)
    # Higher is better (an accuracy): the ratio is best / value; a score <= 0 is never within any tau.
    acc = profiles.ratios({"A": {"w": 0.5}, "B": {"w": 0.25}, "C": {"w": 0.0}}, higher_is_better=True)
    assert acc == {"A": {"w": 1.0}, "B": {"w": 2.0}, "C": {"w": math.inf}}


def test_how_often_a_ranks_above_b_matches_the_exact_bootstrap_distribution_and_is_seeded():
    a = np.array([[1.0, 2.0], [3.0, 1.0], [2.0, 2.5]])  # scores (lower is better) by study and seed
    b = np.array([[2.0, 1.5], [2.0, 2.0], [1.0, 3.0]])
    # Every draw of the two-stage bootstrap is equally likely: 3^3 study draws, each study's 2^2 seed draws.
    wins, draws = 0.0, 0
    seed_draws = list(itertools.product(range(2), repeat=2))
    for studies in itertools.product(range(3), repeat=3):
        for seeds in itertools.product(seed_draws, repeat=3):
            va = np.median([a[s, list(k)].mean() for s, k in zip(studies, seeds)])
            vb = np.median([b[s, list(k)].mean() for s, k in zip(studies, seeds)])
            wins, draws = wins + (va < vb) + 0.5 * (va == vb), draws + 1
    exact = wins / draws
    got = ranking.above(a, b, higher_is_better=False, resamples=40_000, seed=0)
    assert abs(got - exact) < 4 * math.sqrt(exact * (1 - exact) / 40_000)  # four standard errors
    assert got == ranking.above(a, b, higher_is_better=False, resamples=40_000, seed=0)  # seeded: the same
    assert ranking.above(b, a, higher_is_better=False, resamples=40_000, seed=0) == pytest.approx(1 - got)
    assert ranking.value(a) == 2.0  # the median over studies of each study's mean over seeds (1.5, 2, 2.25)
    # Rows keyed by (study, seed): only the studies both rows have with every shared seed count.
    r = ranking.rank("x", {(0, 0): 1.0, (1, 0): 2.0, (2, 0): 5.0}, {(0, 0): 2.0, (1, 0): 1.0}, False, 1000)
    assert r is not None and (r.studies, r.seeds) == (2, 1)


# -- the leaderboard of tuned rows ---------------------------------------------------------------------------------

def _records(tmp_path, values):
    """Tuned rows of two optimizers on two workloads with two studies and two seeds, as cells.json says."""
    from tunelab.report.records import Record
    from tunelab.report.scores import Score

    out = []
    for (opt, wl), by_study in values.items():
        for study, seeds in enumerate(by_study):
            edges = [{"key": "optim.lr", "side": "upper", "value": 9e-3, "low": 1e-5, "high": 1e-2}] if study else []
            summary = {"role": "tuned", "group": f"{opt}-{wl}", "study_index": study, "studies": 2,
                       "sampler": "qmc", "pruner": "halving", "tuned": {"optim.lr": 1e-3 * (study + 1)},
                       "trials": 3, "pruned": 2, "search_steps": 10, "full_steps": 18, "values": [v + 1 for v in seeds],
                       "direction": "minimize", "edges": edges, "metric": "val_loss", "workloads": ["data.recipe"],
                       "method": {"optim.name": opt}, "workload": {"data.recipe": wl}}
            for seed, v in enumerate(seeds):
                slug = f"{opt}-{wl}-tuned-st{study}-s{seed}"
                config = {"optim.name": opt, "data.recipe": wl, "optim.lr": 1e-3 * (study + 1), "train.seed": seed}
                out.append(Record(tmp_path / slug, slug, slug, "e", dict(config), config, "done",
                                  {"val_loss": Score.of("val_loss", {"metric": "loss", "value": v, "n": 8})},
                                  tune=summary))
    return out


VALUES = {("adamw", "arith"): [[1.0, 3.0], [4.0, 4.0]], ("lion", "arith"): [[1.0, 1.0], [2.0, 2.0]],
          ("adamw", "words"): [[2.0, 2.0], [2.0, 2.0]], ("lion", "words"): [[4.0, 4.0], [8.0, 8.0]]}


def test_a_tuned_row_of_several_studies_is_their_median_with_min_max_in_every_format(tmp_path):
    from tunelab.report import leaderboard
    from tunelab.report.table import build

    board = build(_records(tmp_path, VALUES))
    rows = {r["cell"]: r for r in board.rows}
    assert list(rows) == ["adamw-arith-tuned", "lion-arith-tuned", "adamw-words-tuned", "lion-words-tuned"]
    st = rows["adamw-arith-tuned"]["val_loss"]  # study means 2 and 4: their median, [min, max]
    assert (st.mean, st.low, st.high, st.studies, st.n) == (3.0, 2.0, 4.0, 2, 4)
    assert rows["adamw-arith-tuned"]["tuned"] == "optim.lr=0.001 / optim.lr=0.002"
    assert rows["adamw-arith-tuned"]["optim.lr"] is None  # each study's own value: in `tuned`
    assert rows["adamw-arith-tuned"]["search edge"] == "upper edge of optim.lr in 1 of 2 studies: widen the space"
    assert rows["adamw-arith-tuned"]["search trials"] == "6 (4 pruned) in 2 studies"
    # The profile over the two workloads: lion best on arith (1.5 vs 3: adamw 2x), adamw on words (2 vs 6: lion 3x)
    prof = {p["method"]: p for p in board.profiles}
    assert prof["adamw-tuned"]["ratios"] == {"arith": 2.0, "words": 1.0}
    assert prof["lion-tuned"]["ratios"] == {"arith": 1.0, "words": 3.0}
    assert prof["adamw-tuned"]["score"] == pytest.approx((2 + 3) / 3 / 2)
    assert rows["lion-arith-tuned"]["profile score"] == f"{(3 + 1) / 3 / 2:.3f} over 2 workloads"
    md, csv, tex, js = (leaderboard.render(board, f, "t") for f in ("md", "csv", "latex", "json"))
    assert "3 [2, 4]" in md and "median over the studies" in md and "Across workloads" in md
    assert "widen the space" in md and "rests on 2 workloads" in md
    assert "median-of-2-studies" in csv and "val_loss min" in csv and "widen the space" in csv
    assert "3 [2, 4]" in tex and "Across workloads" in tex
    got = json.loads(js)
    first = got["rows"][0]["columns"]["val_loss"]
    assert (first["mean"], first["low"], first["high"], first["studies"]) == (3.0, 2.0, 4.0, 2)
    assert {p["method"] for p in got["profiles"]} == {"adamw-tuned", "lion-tuned"}
    assert "search edge" in leaderboard.frame(board).columns  # the terminal shows what the files show
    rich = leaderboard.to_rich(board, "t")
    assert "search edge" in [c.header for c in rich.columns]


def test_the_report_draws_profiles_edges_ranks_rows_and_says_what_they_cost(tmp_path):
    from tunelab.report import html

    records = _records(tmp_path, VALUES)
    tuned = html._tuned_rows(records)
    ranks = {(r["A"], r["B"]): r for r in html._rankings(tuned)}
    assert set(ranks) == {("adamw-arith-tuned", "lion-arith-tuned"), ("adamw-words-tuned", "lion-words-tuned")}
    assert ranks[("adamw-words-tuned", "lion-words-tuned")]["A ranks above B"] == "100.0%"  # better in every draw
    costs = {r["group"] for r in html._costs(tmp_path, tuned)}  # each row's, and each method's on all workloads
    assert costs == {*(label for label, _ in tuned), "adamw-tuned, all workloads", "lion-tuned, all workloads"}
    from tunelab.report import search_plots
    from tunelab.report.table import build

    png = search_plots.profile_figure(build(records).profiles, profiles.TAU_MAX)
    assert png is not None and png[:4] == b"\x89PNG"


def test_each_ended_run_of_a_cell_is_counted_in_its_rows_cost(tmp_path):
    """attempts.jsonl: every run that ended (paused at a rung, done, failed) adds its seconds x devices; a run
    killed without a word adds nothing. A tuned row's cost: its trials' runs (search, by rung) and its winners'
    retraining and evaluation."""
    runs = tmp_path / "runs" / "m"

    def cell(name, cell_id, ends):
        f = CellFolder(runs / name)
        f.path.mkdir(parents=True)
        (f.path / "cell.json").write_text(json.dumps({"id": cell_id, "layout": 2}))
        for started, finished, state, extra in ends:
            f.write_status("running", started_at=started, world_size=1, device="cpu",
                           evaluating_only=extra.get("evaluating_only", False), paused_at=None)
            if finished is not None:
                f.write_status(state, finished_at=finished, **{k: v for k, v in extra.items()
                                                               if k != "evaluating_only"})
        return f

    trial = cell("g-t00", "t0", [(0, 30, "pending", {"paused_at": 2}), (100, None, "", {}),  # killed: no end
                                 (200, 290, "done", {}), (300, 310, "done", {"evaluating_only": True})])
    cell("g-t01", "t1", [(0, 36, "pending", {"paused_at": 2})])
    seed1 = cell("g-tuned-s1", "w1", [(0, 100, "done", {})])
    assert [a["seconds"] for a in trial.attempts()] == [30, 90, 10]
    (runs / "tune" / "g").mkdir(parents=True)
    (runs / "tune" / "g" / "trials.json").write_text(json.dumps({
        "schedule": [{"rungs": [2, 6], "sizes": [2, 1]}], "trials": [{"cell": "t0"}, {"cell": "t1"}]}))
    got = cost.of_row([{"trials_file": "tune/g/trials.json"}] * 2, [trial.path, seed1.path], cost.Folders(runs))
    assert (got.search_s, got.retrain_s, got.by_rung) == (156.0, 110.0, {2: 66.0, 6: 90.0})
    assert got.text() == f"{266 / 3600:.3g} CPU-h (search {156 / 3600:.3g}, retraining {110 / 3600:.3g})"
