"""Plan time of a matrix's `tune:` section (no training): the method groups, their budget and schedule as `exp plan`
shows them, every bad section refused with exit 2 naming the file and key path, the schedule's arithmetic, the
synchronous rung decision, the samplers' points replayed in trial order, and the winner's retraining cells."""

from __future__ import annotations

import json
import math

import pytest
from conftest import write

from tunelab.matrix import expansion
from tunelab.matrix.tune_section import TuneSpec
from tunelab.tune import plan as tune_plan
from tunelab.tune import sampling, schedule, trials

MATRIX = """name: tp
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  train: {steps: 60, batch_size: 2}
  eval: {tasks: [val_loss]}
  tracking: {wandb: false}
matrix:
  optim.name: [adamw, lion]
include:
  - {optim.name: sgd, tune: {space: {optim.lr: {log_uniform: [1.0e-3, 1.0e-1]}}}}
  - {optim.name: adam, tune: false}
seeds: [0, 1]
tune:
  space: {optim.lr: {log_uniform: [1.0e-6, 1.0e-3]}}
  trials: 9
  pruner: halving
  min_steps: 6
  baseline: true
"""


def plan_json(cli, path, *args):
    code, out, err = cli("plan", path, "--json", *args)
    assert code == 0, err
    return json.loads(out)


def test_plan_shows_each_group_its_trials_and_the_compute_budget(cli, tmp_path):
    path = write(tmp_path / "tp.yaml", MATRIX)
    got = plan_json(cli, path)
    groups = {g["group"]: g for g in got["groups"]}
    assert list(groups) == ["adamw", "lion", "sgd"]  # adam opted out with tune: false
    for g in groups.values():  # the same budget: 9 trials of 60 steps, rungs 7/20/60 keeping 9 -> 3 -> 1
        assert g["schedule"] == "steps 7/20/60: 9 -> 3 -> 1"
        assert g["search_steps"] == 9 * 7 + 3 * 13 + 1 * 40 and g["full_search_steps"] == 9 * 60
        assert g["retrain_steps"] == 60 and g["baseline_steps"] == 120  # seed 0 is the winning trial itself
    assert "log_uniform [0.001, 0.1]" in groups["sgd"]["space"]  # the include entry's own space
    # The cells: each group as written (baseline) and the untuned adam, once per seed.
    assert sorted(c["slug"] for c in got["cells"]) == sorted(
        f"{o}-s{s}" for o in ("adamw", "lion", "sgd", "adam") for s in (0, 1))
    code, out, _ = cli("plan", path)
    assert code == 0 and "3 method groups searched with the same budget" in out and "steps 7/20/60" in out


BAD = {
    "unknown distribution": ("space: {optim.lr: {loguniform: [1.0e-6, 1.0e-3]}}",
                             "tune.space.optim.lr", "unknown distribution 'loguniform'"),
    "empty range": ("space: {optim.lr: {uniform: [1.0e-3, 1.0e-3]}}", "tune.space.optim.lr", "empty range"),
    "log-uniform over a negative bound": ("space: {optim.lr: {log_uniform: [-1.0e-6, 1.0e-3]}}",
                                          "tune.space.optim.lr", "0 < low"),
    "a metric no task produces": ("metric: perplexity", "tune.metric", "no task produces 'perplexity'"),
    "a budget of 0": ("trials: 0", "tune.trials", "greater than 0"),
    "a test set as the objective": ("metric: mmlu", "tune", "scored on its test set"),
    "a bound no cell accepts": ("space: {optim.lr: {uniform: [0, 1.0e-3]}}", "tune.space.optim.lr (at 0.0)",
                                "greater than 0"),
    "an unknown key": ("space: {optim.lrr: {uniform: [0.1, 0.2]}}", "tune.space.optim.lrr", "unknown key"),
    "a matrix axis": ("space: {optim.name: {choice: [adamw, sgd]}}", "tune.space.optim.name", "matrix axis"),
    "the seed": ("space: {train.seed: {int: [0, 9]}}", "tune.space", "seeds are not a hyperparameter"),
    "grid over a continuous range": ("sampler: grid", "tune", "grid needs a finite space"),
    "an unknown sampler": ("sampler: bayes", "tune.sampler", "unknown sampler 'bayes'"),
    "one rung": ("pruner: halving\n  min_steps: 5", "tune.min_steps", "one rung is no pruning"),
    "rungs past the budget": ("pruner: halving\n  min_steps: 30", "tune.min_steps", "leaves no rung below"),
    "hyperband without enough trials": ("pruner: hyperband\n  trials: 2\n  eta: 2\n  min_steps: 2", "tune.min_steps",
                                        "needs at least 3 trials"),
    "eta without rungs": ("eta: 2", "tune", "pruner none has none"),
    "an unknown intermediate value": ("pruner: halving\n  min_steps: 2\n  intermediate: loss", "tune.intermediate",
                                      "unknown intermediate value 'loss'"),
    "a checkpoint intermediate without rungs": ("intermediate: checkpoint", "tune", "pruner none has none"),
    "a negative seed": ("seed: -1", "tune.seed", "greater than or equal to 0"),
    "a seed past numpy's": ("seed: 4294967296", "tune.seed", "less than or equal to 4294967295"),
    "studies past numpy's seeds": ("seed: 4294967295\n  studies: 2", "tune", "the last, 4294967296, is above"),
    "a budget of true": ("trials: true", "tune.trials", "a whole number, not true/false"),
    "a bound of true": ("space: {peft.r: {int: [true, 8]}}", "tune.space.peft.r", "numbers, not true/false"),
    "batch with hyperband": ("pruner: hyperband\n  trials: 6\n  eta: 2\n  min_steps: 2\n  batch: 2", "tune",
                             "hyperband samples each of its brackets as one round"),
    "a study in memory": ("storage: 'sqlite:///'", "tune.storage", "a database in memory"),
    "a choice value twice": ("space: {optim.lr: {choice: [0.001, 1.0e-3, 0.01]}}", "tune.space.optim.lr",
                             "0.001 is named twice"),
}
DEFAULT = {"space": "space: {optim.lr: {log_uniform: [1.0e-6, 1.0e-3]}}", "trials": "trials: 4"}


def section(lines: str) -> str:
    """The tune section: the case's lines, and the default space and trials where the case does not set them."""
    given = [x.strip() for x in lines.splitlines()]
    keys = {x.split(":")[0] for x in given}
    return "".join(f"  {x}\n" for x in [v for k, v in DEFAULT.items() if k not in keys] + given)


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_tune_section_exits_2_naming_the_file_and_key(cli, tmp_path, case):
    lines, key, message = BAD[case]
    text = f"""name: bad
base:
  model: {{name: tiny-random-llama}}
  data: {{recipe: arithmetic}}
  train: {{steps: 8}}
matrix:
  optim.name: [adamw, lion]
tune:
{section(lines)}"""
    path = write(tmp_path / "bad.yaml", text)
    code, out, err = cli("run", path, "--runs-dir", tmp_path / "runs")
    text = " ".join(err.split())
    assert code == 2, err
    assert f"{path}: {key}" in text and message in text, text
    assert "Traceback" not in err and not (tmp_path / "runs").exists()  # nothing half-written


def test_an_unreachable_study_server_exits_2_before_any_trial_trains(cli, tmp_path):
    text = """name: far
base: {model: {name: tiny-random-llama}, data: {recipe: arithmetic}, train: {steps: 4}}
include: [{optim.name: adamw}]
tune: {space: {optim.lr: {log_uniform: [1.0e-4, 1.0e-2]}}, trials: 2, storage: "postgresql://x@127.0.0.1:1/none"}
"""
    code, _, err = cli("run", write(tmp_path / "far.yaml", text), "--runs-dir", tmp_path / "runs")
    assert code == 2 and "cannot open the study storage" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # refused before a trial trained or a file was written


def test_every_group_gets_the_same_budget(cli, tmp_path):
    uneven = MATRIX.replace("{optim.name: sgd, tune: {space:", "{optim.name: sgd, tune: {trials: 12, space:")
    code, _, err = cli("plan", write(tmp_path / "u.yaml", uneven))
    assert code == 2 and "include[0].tune.trials: trials 12 differs from tune.trials 9" in " ".join(err.split())
    longer = MATRIX.replace("{optim.name: sgd, tune:", "{optim.name: sgd, train.steps: 90, tune:")
    code, _, err = cli("plan", write(tmp_path / "l.yaml", longer))
    assert code == 2 and "every method group gets the same budget (trials x train.steps)" in " ".join(err.split())


def test_a_test_set_objective_is_allowed_when_asked_and_marked(cli, tmp_path):
    text = MATRIX.replace("  baseline: true\n", "  baseline: true\n  metric: gsm8k_smoke\n  "
                          "allow_test_selection: true\n").replace("tasks: [val_loss]", "tasks: [gsm8k_smoke]")
    got = plan_json(cli, write(tmp_path / "t.yaml", text))
    assert {g["metric"] for g in got["groups"]} == {"gsm8k_smoke"}
    assert {g["direction"] for g in got["groups"]} == {"maximize"}



def test_scores_a_test_set_selected_are_marked_in_every_format_and_the_provenance(tmp_path):
    """The leaderboard reads a winner's part in its search from cells.json (Record.tune): a configuration chosen on a
    test set's score carries the mark in every format, its note says why, and the report's provenance marks it."""
    from tunelab.report import leaderboard
    from tunelab.report.provenance import score_rows
    from tunelab.report.records import Record
    from tunelab.report.scores import TEST_SELECTED, Score
    from tunelab.report.table import build

    score = Score.of("gsm8k_smoke", {"metric": "em_strict", "value": 0.25, "n": 8})
    summary = {"sampler": "qmc", "pruner": "halving", "tuned": {"optim.lr": 1e-4}, "trials": 4, "pruned": 2,
               "search_steps": 10, "full_steps": 24, "best": 0.3, "median": 0.25, "worst": 0.1}
    records = [Record(tmp_path / slug, slug, slug, "e", {"optim.name": name}, {"optim.name": name}, "done",
                      {"gsm8k_smoke": score}, tune={"role": "tuned", "test_selected": on, **summary})
               for slug, name, on in (("adamw-tuned", "adamw", True), ("lion-tuned", "lion", False))]
    board = build(records)
    md, csv, tex, js = (leaderboard.render(board, f, "t") for f in ("md", "csv", "latex", "json"))
    assert "0.25" + TEST_SELECTED in md and "chosen by its score on a test set" in md
    assert csv.count("test-selected") == 1 and "0.25" + TEST_SELECTED in tex
    rows = {r["optim.name"]: r for r in json.loads(js)["rows"]}
    assert [rows[c]["columns"]["gsm8k_smoke em_strict"]["test_selected"] for c in ("adamw", "lion")] == [True, False]
    assert rows["adamw"]["tuned"] == "optim.lr=0.0001" and rows["adamw"]["search trials"] == "4 (2 pruned)"
    shown = {r["cell"]: r["value"] for r in score_rows(records)}
    assert shown == {"adamw-tuned": "0.25" + TEST_SELECTED, "lion-tuned": "0.25"}


def test_rungs_halving_and_hyperband_budgets():
    assert schedule.rung_steps(60, 3, 6) == (7, 20, 60)  # 60 / 9 rounded: the first rung is at least min_steps
    assert schedule.rung_steps(60, 3, 7) == (20, 60)
    assert schedule.rung_steps(6, 3, 2) == (2, 6)
    s = schedule.build("halving", 9, 60, eta=3, min_steps=6)
    assert s.brackets == (schedule.Bracket((7, 20, 60), (9, 3, 1)),)
    assert s.planned_steps() == 142 and s.full_steps() == 540
    # Hyperband's own proportions at eta 3 over rungs 9/27/81: 9, 5 and 3 trials from rungs 9, 27 and 81.
    hb = schedule.build("hyperband", 17, 81, eta=3, min_steps=9)
    assert [(b.rungs, b.sizes) for b in hb.brackets] == [((9, 27, 81), (9, 3, 1)), ((27, 81), (5, 1)), ((81,), (3,))]
    fewer = schedule.build("hyperband", 13, 81, eta=3, min_steps=9)  # the same proportions, largest remainder
    assert [b.sizes[0] for b in fewer.brackets] == [7, 4, 2]
    rounds = schedule.build("none", 10, 20, batch=4)
    assert [b.sizes for b in rounds.brackets] == [(4,), (4,), (2,)] and rounds.planned_steps() == 200


def test_promotion_depends_on_values_only_ties_by_trial_number_and_nan_last():
    values = [(3, 0.5), (0, float("nan")), (1, 0.5), (2, 0.4), (4, None)]
    assert schedule.promote(values, 3, lower_is_better=True) == [2, 1, 3]
    assert schedule.promote(list(reversed(values)), 3, lower_is_better=True) == [2, 1, 3]
    assert schedule.promote(values, 2, lower_is_better=False) == [1, 3]


def spec(**kw) -> TuneSpec:
    return TuneSpec.model_validate({"space": {"optim.lr": {"log_uniform": [1e-6, 1e-3]},
                                              "peft.r": {"choice": [4, 8, 16]}}, "trials": 6, **kw})


@pytest.mark.parametrize("sampler", ["qmc", "random", "tpe", "grid"])
def test_points_are_replayed_the_same_and_earlier_brackets_never_change(sampler):
    sp = spec(sampler=sampler, batch=3) if sampler != "grid" else TuneSpec.model_validate(
        {"space": {"peft.r": {"choice": [4, 8, 16]}, "peft.alpha": {"int": [8, 9]}}, "trials": 6, "batch": 3,
         "sampler": "grid"})
    sched = schedule.build("none", 6, 10, batch=3)
    first = sampling.points(sp, sched, [])
    told = [[sampling.Told({}, "complete", v) for v in (0.3, 0.1, float("nan"))]]
    second = sampling.points(sp, sched, told)
    assert second[0] == first[0] and len(second) == 2 and len(second[1]) == 3
    assert sampling.points(sp, sched, told) == second  # a fresh replay: the same trials
    every = [json.dumps(p, sort_keys=True) for b in second for p in b]
    assert len(set(every)) == 6  # six different points


def test_qmc_trial_zero_is_a_sobol_point_not_a_random_draw():
    sp = spec(seed=0)
    a = sampling.points(sp, schedule.build("none", 6, 10), [])[0]
    b = sampling.points(spec(seed=1), schedule.build("none", 6, 10), [])[0]
    assert a != b  # the seed scrambles the sequence
    assert all(1e-6 <= p["optim.lr"] <= 1e-3 and p["peft.r"] in (4, 8, 16) for p in a)
    logs = sorted(math.log(p["optim.lr"]) for p in a)  # low discrepancy: no two of 6 points bunch up
    assert min(y - x for x, y in zip(logs, logs[1:])) > 0.05 * (math.log(1e-3) - math.log(1e-6)) / 6


def test_the_winner_is_retrained_once_per_seed_and_its_first_seed_is_the_trial_itself(tmp_path):
    path = write(tmp_path / "tp.yaml", MATRIX)
    spec_, _ = expansion.load(path)
    group = tune_plan.groups(spec_, path)[0]
    trial = trials.trial_cell(group, 4, {"optim.lr": 3e-4})
    finals = trials.final_cells(group, {"optim.lr": 3e-4}, {"group": group.slug})
    assert [c.config.train.seed for c in finals] == [0, 1] and [c.slug for c in finals] == ["adamw-tuned-s0",
                                                                                             "adamw-tuned-s1"]
    assert finals[0].id == trial.id  # same training: the winning trial's folder, evaluated on the suite
    assert trial.config.eval.tasks == ["val_loss"]  # a trial scores only the objective
    assert trial.stop_at is None and trial.meta["tune"] == {"role": "trial", "group": "adamw",
                                                            "study": group.study, "trial": 4}


def test_a_checkpoint_intermediate_gives_each_trial_its_brackets_rungs_to_score_and_keeps_the_winners_id(tmp_path):
    text = MATRIX[:MATRIX.index("\ntune:")] + """
tune:
  space: {optim.lr: {log_uniform: [1.0e-6, 1.0e-3]}}
  trials: 17
  pruner: hyperband
  min_steps: 7
  intermediate: checkpoint
"""
    path = write(tmp_path / "hb.yaml", text.replace("steps: 60", "steps: 63"))
    spec_, _ = expansion.load(path)
    group = tune_plan.groups(spec_, path)[0]
    assert [b.rungs for b in group.schedule.brackets] == [(7, 21, 63), (21, 63), (63,)]
    first = [group.schedule.first_trial(b) for b in range(3)]
    rungs = [trials.trial_cell(group, n, {"optim.lr": 1e-4}).config.eval.checkpoints for n in first]
    assert [(c.at, c.workers) if c else None for c in rungs] == [([7, 21], 0), ([21], 0), None]  # no rung: none
    trial = trials.trial_cell(group, 0, {"optim.lr": 1e-4})
    assert trials.final_cells(group, {"optim.lr": 1e-4}, {})[0].id == trial.id  # the eval is not the training


def test_the_tuned_optimizers_study_plans_as_written_and_as_its_stand_in(cli):
    from conftest import REPO
    from test_paper_studies import stand_in_args

    path = REPO / "experiments" / "paper_tuned_optimizers.yaml"
    full = plan_json(cli, path)
    assert [g["group"] for g in full["groups"]] == ["adamw", "lion", "adan", "adalomo"]
    assert {g["schedule"] for g in full["groups"]} == {"steps 133/400/1200: 16 -> 5 -> 1"}
    assert {g["search_steps"] for g in full["groups"]} == {4263}  # the figures its header gives
    assert len(full["cells"]) == 4 * 3  # each optimizer as written (its default row), 3 seeds
    small = plan_json(cli, path, *stand_in_args("paper_tuned_optimizers"))
    assert {g["schedule"] for g in small["groups"]} == {"steps 4/12: 6 -> 2"}
    assert all(c["config"]["model"]["name"] == "smollm2-135m-instruct" for c in small["cells"])
    # Two workloads (recipes) for each optimizer, 3 studies each; the default rows on both recipes too.
    assert [g["group"] for g in small["groups"]] == [f"{o}-{w}" for o in ("adamw", "lion", "adan", "adalomo")
                                                     for w in ("arithmetic", "wordplay")]
    assert {(g["studies"], tuple(g["workloads"])) for g in small["groups"]} == {(3, ("data.recipe",))}
    assert len(small["cells"]) == 4 * 2


def test_the_study_record_is_idempotent_follows_the_cells_and_survives_a_torn_journal_line(tmp_path):
    from optuna.distributions import FloatDistribution

    from tunelab.core.errors import UserError
    from tunelab.tune import record

    space = {"optim.lr": FloatDistribution(1e-6, 1e-3, log=True)}

    def view(state: str, **kw) -> record.TrialView:
        return record.TrialView(0, 0, {"optim.lr": 1e-4}, "abc", {2: 1.5}, state, reached=6, **kw)

    storage = record.open_storage("journal", tmp_path)
    record.sync(storage, "s", "minimize", space, [view("waiting")], {})
    record.sync(storage, "s", "minimize", space, [view("complete", value=1.25)], {"decisions": []})
    record.sync(storage, "s", "minimize", space, [view("waiting")], {})  # a runner behind: nothing changes
    (trial,) = record.load(storage, "s")[1]
    assert trial.state.name == "COMPLETE" and trial.value == 1.25 and trial.intermediate_values == {2: 1.5}
    with pytest.raises(UserError, match="stored COMPLETE, but its cell says PRUNED"):
        record.sync(storage, "s", "minimize", space, [view("pruned", pruned_at=2)], {})
    with pytest.raises(UserError, match="this search samples"):
        record.sync(storage, "s", "minimize", space, [record.TrialView(0, 0, {"optim.lr": 2e-4}, "abc")], {})
    journal = tmp_path / "tune" / record.JOURNAL
    journal.write_bytes(journal.read_bytes() + b'{"op_code": 5, "worker_id": "torn by a ki')  # kill -9 mid-write
    record.repair_journal(tmp_path)
    storage = record.open_storage("journal", tmp_path)
    record.sync(storage, "t", "minimize", space, [view("pruned", pruned_at=2)], {})
    assert [t.state.name for t in record.load(storage, "t")[1]] == ["PRUNED"]


def test_run_only_matching_nothing_names_the_searches_and_writes_nothing(cli, tmp_path):
    path = write(tmp_path / "tp.yaml", MATRIX)
    code, _, err = cli("run", path, "--only", "zzz*", "--runs-dir", tmp_path / "runs")
    assert code == 2 and "adamw (a search)" in err and "adam-s0" in err
    assert not (tmp_path / "runs" / "tp").exists()


def test_a_mode_against_its_metrics_direction_is_warned(cli, tmp_path):
    text = f"""name: against
base:
  model: {{name: tiny-random-llama}}
  data: {{recipe: arithmetic}}
  train: {{steps: 8}}
tune:
{section("mode: max")}"""
    code, _, err = cli("plan", write(tmp_path / "a.yaml", text))
    assert code == 0 and "tune.mode max on val_loss, whose better scores are lower" in " ".join(err.split()), err
    code, _, err = cli("plan", write(tmp_path / "b.yaml", text.replace("mode: max", "mode: min")))
    assert code == 0 and "whose better scores" not in err
