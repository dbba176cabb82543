"""`exp compare`: paired significance tests over per-item results, refusals, and matrices matched cell by cell."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tunelab.report.stats import mcnemar_exact, paired


def test_mcnemar_exact_matches_the_binomial_test():
    from scipy.stats import binomtest

    a = np.array([1] * 30 + [0] * 10 + [1] * 8 + [0] * 2)
    b = np.array([1] * 30 + [0] * 10 + [0] * 8 + [1] * 2)
    p, (only_a, only_b) = mcnemar_exact(a, b)
    assert (only_a, only_b) == (8, 2)
    assert p == pytest.approx(binomtest(2, 10, 0.5).pvalue, abs=1e-12)
    assert mcnemar_exact(a, a)[0] == 1.0


def test_bootstrap_finds_a_real_difference_and_no_difference():
    rng = np.random.default_rng(1)
    a = (rng.random(200) < 0.3).astype(float)
    b = np.maximum(a, (rng.random(200) < 0.4).astype(float))  # B right wherever A is, and more
    groups = np.array(["x"] * 200)
    r = paired(a, b, groups, resamples=2000)
    assert r.diff == pytest.approx(b.mean() - a.mean()) and r.diff > 0.2
    assert r.ci[0] > 0 and r.p_bootstrap < 1e-3 and r.p_mcnemar < 1e-6 and r.test == "McNemar (exact)"
    same = paired(a, a, groups, resamples=500)
    assert same.diff == 0 and same.p == 1.0 and same.ci == (0.0, 0.0)


def test_macro_average_is_the_mean_of_subtask_means():
    a = np.array([1.0, 1, 1, 1, 0, 0])  # subtask s: 4/4, subtask t: 0/2
    b = np.array([1.0, 1, 1, 0, 1, 1])
    groups = np.array(["s", "s", "s", "s", "t", "t"])
    r = paired(a, b, groups, average="macro", resamples=300)
    assert r.a == pytest.approx(0.5) and r.b == pytest.approx((0.75 + 1) / 2)
    assert r.p_mcnemar is None and r.test == "paired bootstrap"  # McNemar tests a micro average only
    assert not math.isnan(r.p_bootstrap)


def _cell(root, name, items: dict[str, list[int]], varying: dict, config: dict, state="done"):
    """A finished cell folder as tunelab writes it: config, status, summary, results and per-item samples."""
    import yaml

    d = root / name
    ev = d / "eval" / "e1"
    ev.mkdir(parents=True)
    (d / "cell.json").write_text(json.dumps({"slug": name, "id": name, "varying": varying, "layout": 2}))
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    (d / "status.json").write_text(json.dumps({"state": state}))
    (d / "train").mkdir()
    (d / "train" / "summary.json").write_text(json.dumps({"final_loss": 1.0, "tokens_per_s": 100.0,
                                                          "peak_mem_mb": 500.0, "train_seconds": 2.0}))
    tasks, samples = {}, []
    for task, scores in items.items():
        tasks[task] = {"metric": "acc", "value": float(np.mean(scores)), "n": len(scores), "status": "ok"}
        samples += [{"task": task, "subtask": "s", "doc_id": i, "doc_hash": f"h{i}", "acc": v}
                    for i, v in enumerate(scores)]
    (ev / "results.json").write_text(json.dumps({"tasks": tasks, "complete": True}))
    (ev / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return d


def test_cells_compare_on_the_same_items_and_refuse_different_ones(cli, tmp_path):
    a = _cell(tmp_path / "m", "a", {"mmlu": [0] * 40 + [1] * 10}, {"optim.name": "adamw"}, {"optim": {"name": "adamw"}})
    b = _cell(tmp_path / "m", "b", {"mmlu": [1] * 40 + [1] * 10}, {"optim.name": "lion"}, {"optim": {"name": "lion"}})
    code, out, err = cli("compare", a, b, "--json", "--resamples", "500")
    assert code == 0, err
    (c,) = json.loads(out)
    assert c["config_diff"] == {"optim.name": ["adamw", "lion"]}
    (t,) = c["tasks"]
    assert t["diff"] == pytest.approx(0.8) and t["n"] == 50 and t["p"] < 1e-9 and t["discordant"] == [0, 40]
    short = _cell(tmp_path / "m", "c", {"mmlu": [1] * 20}, {"optim.name": "sgd"}, {"optim": {"name": "sgd"}})
    code, out, _ = cli("compare", a, short, "--json", "--resamples", "500")
    (t,) = json.loads(out)[0]["tasks"]
    assert code == 0 and t["refused"].startswith("the two sides scored different items (50 and 20")
    code, out, _ = cli("compare", a, b)
    assert code == 0 and "McNemar" in out and "optim.name" in out
    text = " ".join(out.split())
    assert "mmlu │ 0.2* │ 1* │" in text and "`*`: a subset of the benchmark" in text  # 50 of MMLU's items: marked
    code, out, _ = cli("compare", a, short)
    assert "50 / 20" in out and "+0.8" not in out  # no difference over different items


def test_compare_says_each_sides_state_and_what_is_unavailable(cli, tmp_path):
    a = _cell(tmp_path / "m", "a", {"mmlu": [1, 0]}, {"optim.name": "adamw"}, {"optim": {"name": "adamw"}})
    b = _cell(tmp_path / "m", "b", {"mmlu": [1, 1]}, {"optim.name": "lion"}, {"optim": {"name": "lion"}},
              state="failed")
    results = b / "eval" / "e1" / "results.json"
    got = json.loads(results.read_text())
    got["tasks"]["mmlu"] = {"status": "unavailable", "reason": "no test set here", "value": None, "n": 0}
    got["complete"] = False
    results.write_text(json.dumps(got))
    code, out, err = cli("compare", a, b, "--json", "--resamples", "200")
    assert code == 0, err
    (c,) = json.loads(out)
    assert c["states"] == ["done", "failed, its evaluation not complete: the scores are of the tasks it finished"]
    (t,) = c["tasks"]
    assert t["refused"] == "unavailable on B (no test set here)" and t["marks"][1]["unavailable"]
    code, out, _ = cli("compare", a, b)
    assert "unavailable" in out and "(failed, its evaluation not complete" in " ".join(out.split())


def test_matrices_are_matched_on_the_keys_both_vary(cli, tmp_path):
    for m, shift in (("m1", 0), ("m2", 1)):
        for opt in ("adamw", "lion"):
            _cell(tmp_path / m, opt, {"mmlu": [shift] * 10 + [1] * 10}, {"optim.name": opt},
                  {"optim": {"name": opt}, "train": {"steps": 10 + shift}})
    code, out, err = cli("compare", tmp_path / "m1", tmp_path / "m2", "--json", "--resamples", "200")
    assert code == 0, err
    got = json.loads(out)
    assert sorted(c["a"].rsplit("/", 1)[1] for c in got) == ["adamw", "lion"]
    assert all(c["config_diff"] == {"train.steps": [10, 11]} for c in got)


@pytest.mark.parametrize("args, needle", [
    (["nope", "nope2"], "no such folder"),
    (["MATRIX", "CELL"], "not one of each"),
    (["CELL", "CELL", "--resamples", "5"], "at least 100"),
])
def test_bad_input(cli, tmp_path, args, needle):
    cell = _cell(tmp_path / "m", "a", {"mmlu": [1, 0]}, {}, {})
    args = [str(cell) if x == "CELL" else str(tmp_path / "m") if x == "MATRIX" else
            (str(tmp_path / x) if x.startswith("nope") else x) for x in args]
    code, out, err = cli("compare", *args)
    assert code == 2 and needle in " ".join(err.split()) and "Traceback" not in out + err


def test_single_item_subtasks_do_not_shrink_the_interval_to_a_point():
    """MMLU on one question a subject (the quick suite): resampling within subjects would draw the same item
    every time; the interval must still reflect the spread over items."""
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 2, 57), rng.integers(0, 2, 57)
    groups = np.array([f"s{i}" for i in range(57)])
    for average in ("micro", "macro"):
        r = paired(a.astype(float), b.astype(float), groups, average, resamples=2000)
        assert r.ci[1] - r.ci[0] > 0.1, (average, r.ci)
        assert r.ci[0] <= r.diff <= r.ci[1]


def _lm_eval_cell(root, name, seed: int, items: dict[str, list], varying: dict):
    """A done cell whose results.json and samples.jsonl are as tunelab writes them for lm-eval tasks: IFEval (its
    four accuracies), an lm-eval task named by the user (hellaswag) and a perplexity task (wikitext)."""
    import yaml

    d = root / name
    (d / "eval" / "e1").mkdir(parents=True)
    (d / "cell.json").write_text(json.dumps({"slug": name, "id": name, "varying": varying, "layout": 2}))
    (d / "config.yaml").write_text(yaml.safe_dump({"train": {"seed": seed}, "optim": {"name": varying["optim.name"]}}))
    (d / "status.json").write_text(json.dumps({"state": "done"}))
    ifeval, hella, ppl = items["ifeval"], items["hellaswag"], items["wikitext"]
    ll, words = sum(x[0] for x in ppl), sum(x[1] for x in ppl)
    tasks = {
        "ifeval": {"metric": "prompt_strict", "value": float(np.mean(ifeval)), "n": len(ifeval), "status": "ok",
                   "subset": True, "also": {"inst_strict": 0.5 + seed / 10, "prompt_loose": 0.6, "inst_loose": 0.7}},
        "hellaswag": {"metric": "acc", "value": float(np.mean(hella)), "n": len(hella), "status": "ok",
                      "subset": False, "average": "micro", "higher_is_better": True},
        "wikitext": {"metric": "word_perplexity", "value": math.exp(-ll / words), "n": len(ppl), "status": "ok",
                     "higher_is_better": False, "average": "micro"}}
    rows = [{"task": "ifeval", "subtask": "ifeval", "doc_id": i, "doc_hash": f"i{i}", "item_metric":
             "prompt_level_strict_acc", "prompt_level_strict_acc": bool(v)} for i, v in enumerate(ifeval)]
    rows += [{"task": "hellaswag", "subtask": "hellaswag", "doc_id": i, "doc_hash": f"h{i}", "item_metric": "acc",
              "acc": v} for i, v in enumerate(hella)]
    rows += [{"task": "wikitext", "subtask": "wikitext", "doc_id": i, "doc_hash": f"w{i}",
              "item_metric": "word_perplexity", "word_perplexity": list(v)} for i, v in enumerate(ppl)]
    (d / "eval" / "e1" / "results.json").write_text(json.dumps({"tasks": tasks, "complete": True}))
    (d / "eval" / "e1" / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_lm_eval_tasks_on_the_leaderboard_and_in_compare(cli, tmp_path):
    from tunelab.report.leaderboard import frame
    from tunelab.report.records import collect
    from tunelab.report.table import build

    rng = np.random.default_rng(0)
    ppl = [(-float(rng.uniform(50, 80)), int(rng.integers(20, 30))) for _ in range(30)]
    cells = {}
    for opt, shift in (("adamw", 0), ("lion", 1)):
        for seed in (0, 1):
            items = {"ifeval": [shift] * 20 + [seed] * 10, "hellaswag": [shift, 1 - shift] * 15,
                     "wikitext": [(ll - 5 * shift, n) for ll, n in ppl]}
            cells[opt, seed] = _lm_eval_cell(tmp_path / "m", f"{opt}-s{seed}", seed, items,
                                             {"optim.name": opt, "train.seed": seed})
    row = frame(build(collect(tmp_path / "m"))).set_index("cell")
    assert list(row.index) == ["adamw", "lion"] and (row["runs"] == 2).all()  # seeds folded
    for col in ("ifeval prompt_strict", "ifeval inst_strict", "ifeval prompt_loose", "ifeval inst_loose"):
        assert col in row.columns and row.loc["adamw", col].endswith("*")  # a subset, marked in every column
    assert row.loc["adamw", "ifeval inst_strict"] == "0.55*" and row.loc["adamw", "ifeval inst_strict ±"] != ""
    assert row.loc["lion", "hellaswag acc"] == "0.5" and "wikitext word_perplexity" in row.columns
    board = build(collect(tmp_path / "m"))
    best = {c.name: [r["cell"] for r in board.rows if r[c.name].best] for c in board.columns}
    assert best["wikitext word_perplexity"] == ["adamw"]  # lower is better, as lm-eval says
    code, out, err = cli("compare", cells["adamw", 0], cells["lion", 0], "--json", "--resamples", "300")
    assert code == 0, err
    tests = {t["task"]: t for t in json.loads(out)[0]["tasks"]}
    assert tests["ifeval"]["test"] == "McNemar (exact)" and tests["ifeval"]["discordant"] == [0, 20]
    assert tests["hellaswag"]["test"] == "McNemar (exact)"
    wiki = tests["wikitext"]
    ratio = [math.exp(-sum(ll - 5 * s for ll, _ in ppl) / sum(n for _, n in ppl)) for s in (0, 1)]
    assert wiki["test"] == "paired bootstrap" and wiki["diff"] == pytest.approx(ratio[1] - ratio[0])
    assert wiki["ci"][0] > 0  # every document worse on one side: the perplexity is higher, and surely so
