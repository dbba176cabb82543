"""Any lm-eval task on tunelab's engine: a local task folder (eval.include_path) with one task per request type,
scored by tunelab and by lm-eval's own `hf` model on the same items (parity per item), groups aggregated as
lm-eval does, the fallback to lm-eval's code said in the results, and IFEval with its rule checker offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lm_tasks import GEN, MC, build, ifeval_data

from tunelab import evals
from tunelab.core.config import EvalCfg, ModelCfg
from tunelab.models import loading

MAX_LENGTH = 128  # the documents of tl_ppl are about 60, 360 and 950 tokens: several rolling windows each
TASKS = ["tl_mc", "tl_gen", "tl_ppl", "tl_group", "tl_sample"]


@pytest.fixture(scope="module")
def tiny():
    return loading.load(ModelCfg(name="tiny-random-llama"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build(tmp_path_factory.mktemp("lm-tasks"))


def ours(tiny, cfg: EvalCfg, out: Path) -> tuple[dict, list[dict]]:
    """tunelab's run: one SharedPrefixLM for every task (at the reference's max_length), results and samples."""
    from tunelab.evals.lmeval.lm import SharedPrefixLM

    ctx = evals.Context(out_dir=out)
    ctx._lm = SharedPrefixLM(*tiny, batch_size=cfg.batch_size, max_length=MAX_LENGTH)
    result = evals.run(*tiny, cfg, ctx)["tasks"]
    return result, [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]


def lm_eval_hf(tasks: list, task_manager, model: str = "tiny-random-llama", **kw) -> dict:
    """lm-eval as its CLI runs it: a fresh `hf` model from the folder, batch size 1."""
    import lm_eval

    model_args = {"pretrained": loading.resolve(model), "device": "cpu", "dtype": "float32",
                  "max_length": MAX_LENGTH}
    return lm_eval.simple_evaluate(model="hf", model_args=model_args, tasks=tasks, task_manager=task_manager,
                                   batch_size=1, log_samples=True, **kw)


@pytest.fixture(scope="module")
def runs(tiny, folder, tmp_path_factory):
    from lm_eval.tasks import TaskManager

    cfg = EvalCfg(tasks=TASKS, include_path=str(folder), batch_size=4)
    tm = TaskManager(include_path=str(folder), include_defaults=False)
    theirs = lm_eval_hf(["tl_mc", "tl_gen", "tl_ppl"], tm)
    theirs_group = lm_eval_hf(["tl_group"], tm)
    return ours(tiny, cfg, tmp_path_factory.mktemp("ours")), theirs, theirs_group


def by_doc(samples: list[dict], task: str) -> dict[int, dict]:
    return {s["doc_id"]: s for s in samples if s["task"] == task}


def paired(samples: list[dict], theirs: dict, task: str, n: int) -> list[tuple[dict, dict]]:
    """(our record, lm-eval's sample) of each of the task's n items."""
    mine = by_doc(samples, task)
    assert len(mine) == len(theirs["samples"][task]) == n
    return [(mine[d["doc_id"]], d) for d in theirs["samples"][task]]


def test_loglikelihood_requests_match_lm_eval(runs):
    (res, samples), theirs, _ = runs
    for r, d in paired(samples, theirs, "tl_mc", len(MC)):
        assert r["prompt_hash"] == d["prompt_hash"] and r["acc"] == d["acc"]
        assert [x[0] for x in r["response"]] == pytest.approx([x[0][0] for x in d["resps"]], abs=1e-4)
    assert res["tl_mc"]["value"] == theirs["results"]["tl_mc"]["acc,none"]
    assert res["tl_mc"]["also"]["acc_norm (none)"] == theirs["results"]["tl_mc"]["acc_norm,none"]


def test_a_real_model_matches_lm_eval_item_by_item(folder, tmp_path):
    """The same parity on a trained model, SmolLM2-135M-Instruct (the PyPI wheel's GGUF, dequantized): a random
    tiny model's near-uniform choices would hide a wrong token more easily than a real model's."""
    from lm_eval.tasks import TaskManager

    real = loading.load(ModelCfg(name="smollm2-135m-instruct"))
    res, samples = ours(real, EvalCfg(tasks=["tl_mc", "tl_gen"], include_path=str(folder), batch_size=4), tmp_path)
    tm = TaskManager(include_path=str(folder), include_defaults=False)
    theirs = lm_eval_hf(["tl_mc", "tl_gen"], tm, model="smollm2-135m-instruct")
    for r, d in paired(samples, theirs, "tl_mc", len(MC)):
        assert r["acc"] == d["acc"]
        assert [x[0] for x in r["response"]] == pytest.approx([x[0][0] for x in d["resps"]], abs=1e-3)
    for r, d in paired(samples, theirs, "tl_gen", len(GEN)):
        assert r["raw"] == d["resps"][0][0] and r["response"] == d["filtered_resps"]
    assert res["tl_mc"]["value"] == theirs["results"]["tl_mc"]["acc,none"]
    assert res["tl_gen"]["value"] == theirs["results"]["tl_gen"]["exact_match,first-word"]


def test_generations_match_lm_eval_with_the_tasks_stops_and_filters(runs):
    (res, samples), theirs, _ = runs
    for r, d in paired(samples, theirs, "tl_gen", len(GEN)):
        assert r["raw"] == d["resps"][0][0] and "\n" not in r["raw"]  # generated to the task's stop sequence
        assert r["response"] == d["filtered_resps"]  # the task's regex filter applied to the same text
    assert res["tl_gen"]["metric"] == "exact_match (first-word)" and res["tl_gen"]["shots"] == 2
    assert res["tl_gen"]["value"] == theirs["results"]["tl_gen"]["exact_match,first-word"]


def test_rolling_loglikelihoods_match_lm_eval_over_several_windows(tiny, runs):
    from lm_eval.utils import get_rolling_token_windows

    (res, samples), theirs, _ = runs
    mine = by_doc(samples, "tl_ppl")
    for d in theirs["samples"]["tl_ppl"]:
        ll, words = mine[d["doc_id"]]["word_perplexity"]
        assert ll == pytest.approx(d["word_perplexity"][0], abs=1e-4) and words == d["word_perplexity"][1]
    ref = theirs["results"]["tl_ppl"]
    assert res["tl_ppl"]["value"] == pytest.approx(ref["word_perplexity,none"], rel=1e-6)
    assert res["tl_ppl"]["also"]["bits_per_byte (none)"] == pytest.approx(ref["bits_per_byte,none"], rel=1e-6)
    assert res["tl_ppl"]["higher_is_better"] is False  # lm-eval's: the leaderboard marks the lowest best
    windows = sum(len(list(get_rolling_token_windows(tiny[1].encode(d["doc"]["text"], add_special_tokens=False), 0,
                                                    MAX_LENGTH, 1))) for d in theirs["samples"]["tl_ppl"])
    assert windows > 3 and res["tl_ppl"]["served"] == {"loglikelihood_rolling": {"engine": windows}}


def test_group_aggregation_equals_lm_eval_weighted_and_not(runs):
    (res, _), _, theirs = runs
    group, ref = res["tl_group"], theirs["results"]
    assert group["value"] == pytest.approx(ref["tl_group"]["acc,none"], abs=1e-12)  # weighted by size
    assert group["also"]["acc_norm (none)"] == pytest.approx(ref["tl_group"]["acc_norm,none"], abs=1e-12)  # not
    assert group["average"] == "micro" and group["n"] == len(MC) + 3
    assert {k: v["value"] for k, v in group["subtasks"].items()} == {
        t: ref[t]["acc,none"] for t in ("tl_mc", "tl_mc2")}


def test_results_say_which_code_served_each_request(runs):
    (res, _), _, _ = runs
    assert res["tl_mc"]["served"] == {"loglikelihood": {"engine": 4 * len(MC)}}
    assert res["tl_gen"]["served"] == {"generate_until": {"engine": len(GEN)}}
    # sampling is not the engine's: lm-eval's hf code generates, and the results say so
    (why,) = res["tl_sample"]["served"]["generate_until"]
    assert why.startswith("hf: sampling") and res["tl_sample"]["served"]["generate_until"][why] == len(GEN)
    for name in TASKS:
        r = res[name]
        assert r["status"] == "ok" and float(r["task_version"]) == 1.0 and r["prompt_hash"] and r["lm_eval_version"]
        assert r["data_source"].startswith("files:") and r["subset"] is False


def test_ifeval_runs_on_the_engine_with_its_rule_checker_offline(tiny, tmp_path):
    from lm_eval.tasks import TaskManager

    from tunelab.evals.testsets.exemplars import lm_eval_tasks_dir

    root = ifeval_data(tmp_path / "data")
    cfg = EvalCfg(tasks=["ifeval"], data_dir=str(root), max_new_tokens=24, batch_size=4)
    res, samples = ours(tiny, cfg, tmp_path / "ours")
    r = res["ifeval"]
    assert r["status"] == "ok" and r["n"] == 3 and r["subset"] is True and r["data_source"] == f"local:{root}"
    assert r["metric"] == "prompt_strict" and set(r["also"]) == {"inst_strict", "prompt_loose", "inst_loose"}
    assert r["served"] == {"generate_until": {"engine": 3}}
    # lm-eval's own ifeval on the same file (a member of a group takes the override), with its hf model
    files = {"dataset_path": "json", "dataset_name": None,
             "dataset_kwargs": {"data_files": {"train": str(root / "ifeval" / "train.jsonl")}}}
    tm = TaskManager(include_path=str(lm_eval_tasks_dir() / "ifeval"), include_defaults=False)
    ref = lm_eval_hf([{"group": "ref", "task": [{"task": "ifeval", **files}]}], tm, gen_kwargs={"max_gen_toks": 24})
    mine = by_doc(samples, "ifeval")
    for d in ref["samples"]["ifeval"]:
        assert mine[d["doc_id"]]["raw"] == d["resps"][0][0]
    metrics = {"prompt_strict": "prompt_level_strict_acc", "inst_strict": "inst_level_strict_acc",
               "prompt_loose": "prompt_level_loose_acc", "inst_loose": "inst_level_loose_acc"}
    got = {"prompt_strict": r["value"], **r["also"]}
    assert got == {k: ref["results"]["ifeval"][f"{m},none"] for k, m in metrics.items()}


def test_ifeval_without_its_test_set_is_unavailable(tiny, tmp_path):
    out = evals.run(*tiny, EvalCfg(tasks=["ifeval"]), evals.Context(out_dir=tmp_path))["tasks"]["ifeval"]
    assert out["status"] == "unavailable" and out["value"] is None
    assert "google/IFEval" in out["reason"] and "ifeval/train.jsonl" in out["reason"]
    gone = evals.run(*tiny, EvalCfg(tasks=["ifeval"], data_dir=str(tmp_path / "none")),
                     evals.Context(out_dir=tmp_path / "b"))["tasks"]["ifeval"]
    assert gone["status"] == "unavailable" and "ifeval/train.jsonl is missing" in gone["reason"]


def test_adding_a_benchmark_is_one_task_yaml_and_one_registry_entry(tiny, folder, tmp_path, monkeypatch):
    """docs/ARCHITECTURE.md's recipe, followed: the task YAML (here in an include_path folder, standing in for
    tasks/<name>/) and one TaskSpec in the TASKS registry; plan, results, the marks and the leaderboard follow."""
    from tunelab.core.registries import TASKS, Harness, TaskSpec
    from tunelab.core.registry import Lazy
    from tunelab.plan import eval_config
    from tunelab.report.scores import Score

    monkeypatch.setattr(TASKS, "_entries", dict(TASKS._entries))  # the entry below lives for this test only
    TASKS.add("tiny_bench", TaskSpec(
        Lazy("tunelab.evals.suite:harness_task"), "a five-question multiple-choice benchmark", official_n=10,
        harness=Harness("tl_mc", "acc", "none", "acc", "accuracy over the questions", also=(("acc_norm", "none"),),
                        made_from="tests/lm_tasks.py")))
    cfg = eval_config({"tasks": ["tiny_bench"], "include_path": str(folder), "batch_size": 4})
    r = evals.run(*tiny, cfg, evals.Context(out_dir=tmp_path))["tasks"]["tiny_bench"]
    assert r["status"] == "ok" and r["metric"] == "acc" and r["n"] == len(MC) and set(r["also"]) == {
        "acc_norm (none)"}
    assert r["subset"] is True and r["data_source"] == "tests/lm_tasks.py"  # 5 of the official 10 items
    score = Score.of("tiny_bench", r)
    assert score.header == "tiny_bench acc" and score.subset and not score.stand_in


def test_a_groups_members_and_limits_make_a_marked_subset(tiny, folder, runs, tmp_path):
    (res, _), _, _ = runs
    cfg = EvalCfg(tasks=["tl_group", "tl_mc"], include_path=str(folder), subtasks={"tl_group": ["tl_mc2"]},
                  limits={"tl_mc": 2}, batch_size=4)
    out = evals.run(*tiny, cfg, evals.Context(out_dir=tmp_path))["tasks"]
    group, mc = out["tl_group"], out["tl_mc"]
    assert set(group["subtasks"]) == {"tl_mc2"} and group["n"] == 3 and group["subset"] is True
    assert group["value"] == res["tl_group"]["subtasks"]["tl_mc2"]["value"]  # the group's aggregate of one member
    assert mc["n"] == 2 and mc["subset"] is True and mc["limit"] == 2


@pytest.mark.parametrize("hf_at", [0, 1])
def test_one_call_mixing_engine_and_hf_generations_answers_each_request_in_place(tiny, hf_at):
    """A generate_until call whose requests are served partly by the engine and partly by lm-eval's hf code (here a
    generation argument the engine does not take): each answer lands at its own request, as when asked alone."""
    from lm_eval.api.instance import Instance

    from tunelab.evals.lmeval.lm import SharedPrefixLM

    contexts = ["The quick brown fox jumps over", "Once upon a time there was a", "In the beginning"]
    greedy = {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}
    kwargs = [greedy] * 3
    kwargs[hf_at] = {**greedy, "repetition_penalty": 1.0}  # the same greedy text, through hf's code
    lm = SharedPrefixLM(*tiny, batch_size=2)

    def ask(pairs):
        return lm.generate_until([Instance("generate_until", {}, (c, k), i) for i, (c, k) in enumerate(pairs)])

    each = [ask([(c, greedy)])[0] for c in contexts]
    assert ask(list(zip(contexts, kwargs))) == each
    assert len(set(each)) == 3  # distinct answers: one in the wrong place would show
