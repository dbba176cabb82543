"""Bad recipes and bad rows: a UserError that names the recipe file, the source and the field."""

from __future__ import annotations

import pytest
from test_data_util import alpaca_rows, tiny_tokenizer, write_recipe, write_rows

from tunelab.core.config import DataCfg
from tunelab.core.errors import UserError
from tunelab.data.build import build
from tunelab.data.recipe import load_recipe


def _fails(tmp_path, rows=None, suffix=".jsonl", cfg=None, **recipe) -> str:
    if rows is not None:
        write_rows(tmp_path / f"rows{suffix}", rows)
    recipe.setdefault("sources", [{"path": f"rows{suffix}"}])
    recipe.setdefault("val_size", 1)
    path = write_recipe(tmp_path / "bad.yaml", **recipe)
    with pytest.raises(UserError) as e:
        build(DataCfg(recipe=str(path), max_length=128, **(cfg or {})), tiny_tokenizer(), tmp_path / "cache")
    msg = str(e.value)
    assert str(path) in msg
    return msg


def test_missing_field_names_source_row_and_field(tmp_path):
    rows = alpaca_rows(3)
    del rows[1]["output"]
    msg = _fails(tmp_path, rows)
    assert "sources[0].fields.output" in msg and "row 1" in msg and "'output'" in msg and "rows.jsonl" in msg


def test_mapped_field_missing_names_the_column(tmp_path):
    rows = [{"instruction": "a", "context": "", "answer": "b"}] * 2
    msg = _fails(tmp_path, rows, sources=[{"path": "rows.jsonl", "fields": {"output": "response"}}])
    assert "no column 'response'" in msg and "format field 'output'" in msg and "'answer'" in msg


def test_wrong_type_names_field_and_type(tmp_path):
    rows = alpaca_rows(3)
    rows[2]["output"] = 42
    msg = _fails(tmp_path, rows)
    assert "row 2" in msg and "'output'" in msg and "is a int, expected a str" in msg


def test_bad_conversation_turn(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]}]
    msg = _fails(tmp_path, rows, sources=[{"path": "rows.jsonl", "format": "messages"}])
    assert "sources[0].fields.messages" in msg and "'robot'" in msg


def test_source_with_no_rows_after_filtering(tmp_path):
    write_rows(tmp_path / "good.jsonl", alpaca_rows(5))
    rows = [{"instruction": "x", "input": "", "output": "   "}] * 3
    msg = _fails(tmp_path, rows, sources=[{"path": "good.jsonl"}, {"path": "rows.jsonl"}])
    assert "sources[1]" in msg and "yields no examples" in msg and "'empty_response': 3" in msg


def test_source_dropped_by_token_filter(tmp_path):
    msg = _fails(tmp_path, alpaca_rows(4), filters={"max_tokens": 10})
    assert "sources[0]" in msg and "above_max_tokens" in msg


def test_weight_that_does_not_parse(tmp_path):
    msg = _fails(tmp_path, alpaca_rows(4), sources=[{"path": "rows.jsonl", "weight": "2x"}])
    assert "sources.0.weight" in msg and "valid number" in msg and "'2x'" in msg


def test_negative_weight(tmp_path):
    msg = _fails(tmp_path, alpaca_rows(4), sources=[{"path": "rows.jsonl", "weight": -1}])
    assert "sources.0.weight" in msg and "greater than 0" in msg


def test_template_that_drops_the_response(tmp_path):
    write_rows(tmp_path / "rows.jsonl", alpaca_rows(4))
    path = write_recipe(tmp_path / "bad.yaml", template="chat", sources=[{"path": "rows.jsonl"}], val_size=1)
    tok = tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                         "{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(UserError) as e:
        build(DataCfg(recipe=str(path), max_length=128), tok, tmp_path / "cache")
    msg = str(e.value)
    assert str(path) in msg and "template" in msg and "sources[0]" in msg and "drops the response" in msg


def test_chat_template_without_tokenizer_template(tmp_path):
    write_rows(tmp_path / "rows.jsonl", alpaca_rows(4))
    path = write_recipe(tmp_path / "r.yaml", sources=[{"path": "rows.jsonl"}], val_size=1)
    with pytest.raises(UserError, match="needs a tokenizer with a chat_template"):
        build(DataCfg(recipe=str(path), max_length=128, template="chat"), tiny_tokenizer(chat=False), tmp_path)


@pytest.mark.parametrize("source, expect", [
    ({"path": "a.jsonl", "generator": "arithmetic"}, "exactly one of"),
    ({"args": {}}, "exactly one of"),
    ({"path": "a.jsonl", "format": "vicuna"}, "unknown format 'vicuna'"),
    ({"path": "a.jsonl", "fields": {"answer": "x"}}, "not fields of format 'alpaca'"),
    ({"path": "a.jsonl", "colour": 1}, "sources.0.colour: unknown key"),
    ({"generator": "nope"}, "unknown generator 'nope'"),
])
def test_schema_errors_name_the_key(tmp_path, source, expect):
    path = write_recipe(tmp_path / "bad.yaml", sources=[source])
    with pytest.raises(UserError, match="bad.yaml") as e:
        load_recipe(str(path))
    assert expect in str(e.value)


def test_unknown_file_type_and_bad_json_line(tmp_path):
    (tmp_path / "rows.txt").write_text("hello")
    assert "the file types read are" in _fails(tmp_path, sources=[{"path": "rows.txt"}])
    (tmp_path / "rows.jsonl").write_text('{"instruction": "a", "output": "b"}\n{oops\n')
    assert "line 2 is not JSON" in _fails(tmp_path)
    assert "does not exist" in _fails(tmp_path, sources=[{"path": "missing.csv"}])


def test_val_size_too_large(tmp_path):
    assert "leaves none for training" in _fails(tmp_path, alpaca_rows(3), val_size=3)


def test_hub_source_offline_says_what_to_do(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub

    # Both read HF_HUB_OFFLINE when imported, which may be before conftest sets it.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    msg = _fails(tmp_path, sources=[{"hub": "tunelab-test/does-not-exist"}])
    assert "sources[0].hub" in msg and "does-not-exist" in msg and "local copy" in msg


def test_data_cfg_rejects_unknown_template():
    from tunelab.plan import Invalid, section_config

    with pytest.raises(Invalid, match="unknown template 'vicuna'"):
        section_config("data", {"recipe": "arithmetic", "template": "vicuna"})
