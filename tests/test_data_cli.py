"""`exp data build | stats | preview` on a local recipe with a tokenizer folder."""

from __future__ import annotations

import json

import pytest
from test_data_util import alpaca_rows, tiny_tokenizer, write_recipe, write_rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    tiny_tokenizer().save_pretrained(d / "tok")
    write_rows(d / "a.jsonl", alpaca_rows(30, prefix="A ") + alpaca_rows(2, prefix="A "))  # 2 duplicates
    write_rows(d / "b.jsonl", [{"messages": [{"role": "user", "content": f"Hi {i}"},
                                             {"role": "assistant", "content": f"Hello {i}"}]} for i in range(10)])
    recipe = write_recipe(d / "mix.yaml", sources=[{"path": "a.jsonl"}, {"path": "b.jsonl", "format": "messages",
                                                                          "weight": 2}], val_size=4)
    return recipe, d


def test_build_then_cached(cli, setup):
    recipe, d = setup
    args = ("data", "build", recipe, "--model", d / "tok", "--max-length", "128", "--cache-dir", d / "cache")
    code, out, err = cli(*args)
    assert code == 0, err
    assert "built in" in out and "validation 4 rows" in out
    code, out, _ = cli(*args)
    assert code == 0 and "cached" in out


def test_output_to_a_pipe_keeps_each_line_whole(cli, setup):
    """A pipe or log file has no width: a path longer than a terminal's line is printed on one line, whole."""
    recipe, d = setup
    deep = d / ("x" * 60) / ("y" * 60)
    code, out, err = cli("data", "build", recipe, "--model", d / "tok", "--max-length", "128", "--cache-dir", deep)
    assert code == 0, err
    assert any(line.startswith(str(deep / "data")) for line in out.splitlines()), out


def test_stats_counts(cli, setup):
    recipe, d = setup
    code, out, err = cli("data", "stats", recipe, "--model", d / "tok", "--max-length", "64", "--cache-dir",
                         d / "cache", "--json")
    assert code == 0, err
    s = json.loads(out)
    a, b = s["sources"]
    assert (a["read"], a["duplicates_exact"], b["read"]) == (32, 2, 10)
    assert s["duplicates_removed"]["exact"] == 2
    assert s["truncated"] > 0 and 0 < s["truncated_share"] < 1  # Alpaca prompts exceed 64 tokens
    assert b["train_weighted"] == 2 * b["train"]
    assert s["tokens_untruncated"]["p50"] <= s["tokens_untruncated"]["p99"] <= s["tokens_untruncated"]["max"]
    code, out, _ = cli("data", "stats", recipe, "--model", d / "tok", "--max-length", "64", "--cache-dir", d / "cache")
    assert code == 0 and "p99" in out and "truncated" in out and "duplicates, exact" in out


def test_preview_shows_trained_tokens(cli, setup):
    recipe, d = setup
    code, out, err = cli("data", "preview", recipe, "-n", "2", "--model", d / "tok")
    assert code == 0, err
    assert "sources[0]" in out and "sources[1]" in out  # a mixture's preview shows each source
    assert "### Response:" in out and "trained" in out and "⏎EOS" in out
    code, out, _ = cli("data", "preview", recipe, "-n", "1")
    assert code == 0 and "text segments" in out


def test_cli_bad_input_exits_2(cli, setup, tmp_path):
    recipe, d = setup
    code, _, err = cli("data", "build", "no-such-recipe", "--model", d / "tok")
    assert code == 2 and "no recipe 'no-such-recipe'" in err
    code, _, err = cli("data", "build", recipe, "--model", d / "tok", "--truncation", "middle")
    assert code == 2 and "--truncation" in err
    bad = write_recipe(tmp_path / "bad.yaml", sources=[{"path": "a.jsonl", "weight": "lots"}])
    code, _, err = cli("data", "preview", bad)
    assert code == 2 and "sources.0.weight" in err
