"""The lm-eval bridge on a tiny random Llama and small fixtures in the hub datasets' schema:
parity with lm-eval's own built-in tasks, batch-size invariance, provenance, unavailable data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tunelab import evals
from tunelab.core.config import EvalCfg, ModelCfg
from tunelab.models import loading

FIXTURES = Path(__file__).parent / "fixtures" / "eval"
SUBJECTS = ["abstract_algebra", "anatomy"]
GEN_TOKENS = 12


@pytest.fixture(scope="module")
def tiny():
    return loading.load(ModelCfg(name="tiny-random-llama"))


def tunelab_run(tiny, out: Path, batch_size: int, tasks=("mmlu", "gsm8k")) -> dict:
    cfg = EvalCfg(tasks=list(tasks), data_dir=str(FIXTURES), subtasks={"mmlu": SUBJECTS},
                  max_new_tokens=GEN_TOKENS, batch_size=batch_size)
    return {**evals.run(*tiny, cfg, evals.Context(out_dir=out)), "_out": out}


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    return {bs: tunelab_run(tiny, tmp_path_factory.mktemp(f"bs{bs}"), bs) for bs in (1, 16)}


def lm_eval_builtin_run() -> dict:
    """lm-eval as its CLI runs it: a fresh HFLM loaded from the model folder and lm-eval's own mmlu_* and
    gsm8k_cot task definitions, pointed at the same local files."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from tunelab.evals.testsets.exemplars import lm_eval_tasks_dir

    def files(local, name, splits):
        return {"dataset_path": "json", "dataset_name": None,
                "dataset_kwargs": {"data_files": {s: str(FIXTURES / local / name / f"{s}.jsonl") for s in splits}}}

    tasks = [{"task": f"mmlu_{s}", "num_fewshot": 5, **files("mmlu", s, ["test", "dev"])} for s in SUBJECTS]
    tasks.append({"task": "gsm8k_cot", **files("gsm8k", "main", ["test"])})
    # A dict naming a registered task replaces its config; as a member of a group it overrides it.
    tasks = [{"group": "parity", "task": tasks}]
    lm_tasks = lm_eval_tasks_dir()
    tm = TaskManager(include_defaults=False, include_path=[str(lm_tasks / "mmlu" / "default"), str(lm_tasks / "gsm8k")])
    folder = loading.resolve("tiny-random-llama")
    return lm_eval.simple_evaluate(model="hf", model_args={"pretrained": folder, "device": "cpu", "dtype": "float32"},
                                   tasks=tasks, task_manager=tm, batch_size=4, log_samples=True,
                                   gen_kwargs={"max_gen_toks": GEN_TOKENS})


def test_scores_equal_lm_eval_builtin_tasks_on_the_same_data(runs):
    ours = runs[16]["tasks"]
    ref = lm_eval_builtin_run()
    for s in SUBJECTS:
        assert ours["mmlu"]["subtasks"][s]["value"] == pytest.approx(ref["results"][f"mmlu_{s}"]["acc,none"], abs=1e-6)
        assert ours["mmlu"]["subtasks"][s]["n"] == 3
    n_right = sum(ref["results"][f"mmlu_{s}"]["acc,none"] * 3 for s in SUBJECTS)
    assert ours["mmlu"]["value"] == pytest.approx(n_right / 6, abs=1e-6)
    g = ref["results"]["gsm8k_cot"]
    assert ours["gsm8k"]["value"] == pytest.approx(g["exact_match,strict-match"], abs=1e-6)
    flexible = ours["gsm8k"]["also"]["exact_match (flexible-extract)"]
    assert flexible == pytest.approx(g["exact_match,flexible-extract"], abs=1e-6)
    assert ours["gsm8k"]["shots"] == 8 and ours["mmlu"]["shots"] == 5
    # Stronger than equal accuracies: the same prompts, log-likelihoods and generations.
    ref_ll = {(s, d["doc_id"]): [r[0][0] for r in d["resps"]] for s in SUBJECTS for d in ref["samples"][f"mmlu_{s}"]}
    ref_prompts = {(s, d["doc_id"]): d["prompt_hash"] for s in SUBJECTS for d in ref["samples"][f"mmlu_{s}"]}
    ours_samples = [json.loads(line) for line in (runs[16]["_out"] / "samples.jsonl").read_text().splitlines()]
    mmlu = [r for r in ours_samples if r["task"] == "mmlu"]
    assert len(mmlu) == 6
    for r in mmlu:
        assert r["prompt_hash"] == ref_prompts[(r["subtask"], r["doc_id"])]
        assert [x[0] for x in r["response"]] == pytest.approx(ref_ll[(r["subtask"], r["doc_id"])], abs=1e-4)
    ref_gen = {d["doc_id"]: d["resps"][0][0] for d in ref["samples"]["gsm8k_cot"]}
    gen = {r["doc_id"]: r["raw"] for r in ours_samples if r["task"] == "gsm8k"}
    assert gen == ref_gen and len(gen) == 4


def test_scores_do_not_depend_on_batch_size(runs):
    one, sixteen = runs[1]["tasks"], runs[16]["tasks"]
    for task in ("mmlu", "gsm8k"):
        assert one[task]["value"] == sixteen[task]["value"]
        assert one[task]["prompt_hash"] == sixteen[task]["prompt_hash"]
    assert one["mmlu"]["subtasks"] == sixteen["mmlu"]["subtasks"]
    raw = {bs: [json.loads(x).get("raw") for x in (runs[bs]["_out"] / "samples.jsonl").read_text().splitlines()]
           for bs in runs}
    assert raw[1] == raw[16] and len([r for r in raw[1] if r is not None]) == 4


def test_results_carry_their_provenance(runs):
    written = json.loads((runs[16]["_out"] / "results.json").read_text())
    assert written["versions"]["lm_eval"] == "0.4.13" and written["versions"]["tunelab"]
    assert written["chat_template"].startswith("none")
    for r in written["tasks"].values():
        assert r["status"] == "ok"
        for key in ("metric", "value", "stderr", "n", "shots", "task_version", "prompt_hash", "task_config_hash",
                    "data_source", "headline", "chat_template", "lm_eval_version"):
            assert key in r, key
        assert r["data_source"] == f"local:{FIXTURES}"
    # fewer items than the official test sets (the fixtures hold a few questions): subsets, both
    assert written["tasks"]["mmlu"]["subset"] is True and written["tasks"]["gsm8k"]["subset"] is True
    assert written["tasks"]["mmlu"]["metric"] == "acc" and written["tasks"]["gsm8k"]["metric"] == "em_strict"


def test_an_unreachable_test_set_is_reported_not_scored(tiny, tmp_path):
    from tunelab.report.leaderboard import frame
    from tunelab.report.records import collect
    from tunelab.report.table import build

    cfg = EvalCfg(tasks=["gsm8k", "bbh"], data_dir=str(tmp_path / "empty"), subtasks={"bbh": ["navigate"]})
    cell = tmp_path / "m" / "cell"
    out = evals.run(*tiny, cfg, evals.Context(out_dir=cell / "eval"))
    for task in ("gsm8k", "bbh"):
        r = out["tasks"][task]
        assert r["status"] == "unavailable" and r["value"] is None and "missing" in r["reason"]
    (cell / "cell.json").write_text(json.dumps({"slug": "cell", "id": "x"}))
    (cell / "config.yaml").write_text("{}")
    (cell / "status.json").write_text(json.dumps({"state": "done"}))
    row = frame(build(collect(tmp_path / "m"))).iloc[0]
    assert row["gsm8k em_strict"] == "unavailable" and row["bbh em_macro"] == "unavailable"


def test_bbh_and_smoke_variants_run_and_say_what_they_are(tiny, tmp_path):
    cfg = EvalCfg(tasks=["bbh", "bbh_smoke", "gsm8k_smoke"], data_dir=str(FIXTURES), max_new_tokens=4, limit=2,
                  subtasks={"bbh": ["navigate", "boolean_expressions"], "bbh_smoke": ["navigate"]})
    out = evals.run(*tiny, cfg, evals.Context(out_dir=tmp_path))["tasks"]
    assert out["bbh"]["n"] == 4 and out["bbh"]["shots"] == 3
    assert set(out["bbh"]["subtasks"]) == {"navigate", "boolean_expressions"}
    assert out["bbh"]["value"] == pytest.approx(out["bbh"]["macro"])  # the headline is the macro average
    assert out["bbh_smoke"]["n"] == 2 and out["bbh_smoke"]["shots"] == 2
    assert out["gsm8k_smoke"]["n"] == 2 and out["gsm8k_smoke"]["shots"] == 8
    for smoke in ("bbh_smoke", "gsm8k_smoke"):
        assert out[smoke]["headline"].startswith("SMOKE, not") and out[smoke]["data_source"]


def test_each_task_reports_its_progress_to_the_end(tiny, tmp_path):
    """The runner's eval bar: EvalProgress events per task, counts that only grow, a last one at the total."""
    from tunelab.core.events import EvalProgress, EvalTask

    seen = []
    cfg = EvalCfg(tasks=["mmlu", "gsm8k"], data_dir=str(FIXTURES), subtasks={"mmlu": SUBJECTS},
                  max_new_tokens=GEN_TOKENS, batch_size=4, limit=3)
    evals.run(*tiny, cfg, evals.Context(out_dir=tmp_path / "a"), seen.append)
    cfg = EvalCfg(tasks=["humaneval"], max_new_tokens=GEN_TOKENS, batch_size=4, limit=3)  # the package's copy
    evals.run(*tiny, cfg, evals.Context(out_dir=tmp_path / "b"), seen.append)
    assert [e.task for e in seen if isinstance(e, EvalTask)] == ["mmlu", "gsm8k", "humaneval"]
    for task in ("mmlu", "gsm8k", "humaneval"):
        marks = [(e.done, e.total) for e in seen if isinstance(e, EvalProgress) and e.task == task]
        assert marks, task
        assert [d for d, _ in marks] == sorted(d for d, _ in marks), task
        assert marks[-1][0] == marks[-1][1] > 0, task


def test_a_group_with_one_item_per_subtask_still_has_a_stderr(tiny, tmp_path):
    """lm-eval pools its subtasks' stderrs for a group, and a one-item subtask has none (MMLU at one question
    per subject, as the quickstart scores it); the group's stderr is then the item mean's."""
    from tunelab.evals.lmeval.harness import item_stderr

    cfg = EvalCfg(tasks=["mmlu"], data_dir=str(FIXTURES), subtasks={"mmlu": SUBJECTS}, limit=1)
    out = evals.run(*tiny, cfg, evals.Context(out_dir=tmp_path))["tasks"]["mmlu"]
    assert all(v["stderr"] is None and v["n"] == 1 for v in out["subtasks"].values())  # lm-eval's N/A
    items = [json.loads(x)["acc"] for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(items) == 2 and out["stderr"] == pytest.approx(item_stderr(out["value"], items))
    assert item_stderr(0.75, [1, 0, 1, 1]) == pytest.approx(0.25)  # stdev 0.5 over sqrt(4)
    assert item_stderr(0.5, [1, 0, 1, 1]) is None  # a value that is not the item mean gets no stderr
    assert item_stderr(1.0, [1]) is None
