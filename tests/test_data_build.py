"""The build: sources and formats in, label-masked token ids out; templates, truncation, split, weights, cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from test_data_util import alpaca_rows, tiny_tokenizer, write_recipe, write_rows

from tunelab.core.config import DataCfg
from tunelab.core.paths import REPO_ROOT
from tunelab.data.build import build, build_info
from tunelab.data.templates import ALPACA_INPUT, ALPACA_NO_INPUT, TEMPLATES
from tunelab.data.tokenize import IGNORE

TOK = tiny_tokenizer()
EOS = TOK.eos_token_id


def _ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def _build(tmp_path: Path, rows=None, name="rows.jsonl", cfg=None, **recipe):
    if rows is not None:
        write_rows(tmp_path / name, rows)
    recipe.setdefault("sources", [{"path": name}])
    recipe.setdefault("val_size", 1)
    path = write_recipe(tmp_path / "r.yaml", **recipe)
    return build_info(DataCfg(recipe=str(path), **{"max_length": 256, **(cfg or {})}), TOK, tmp_path / "cache")


def _all(built):
    return [r for split in ("train", "validation") for r in built.datasets[split]]


def test_alpaca_prompts_are_stanfords_exact_strings():
    assert ALPACA_INPUT == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:")
    assert ALPACA_NO_INPUT == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\n{instruction}\n\n### Response:")


@pytest.mark.parametrize("inp", ["", "some input"])
def test_alpaca_labels_mask_exactly_the_prompt_and_append_eos(tmp_path, inp):
    row = {"instruction": "Add 2 and 3.", "input": inp, "output": "The answer is 5."}
    built = _build(tmp_path, [row, {**row, "output": "Five."}])
    ex = next(r for r in _all(built) if r["labels"][-2] != IGNORE and len(r["labels"]) > 20 and
              TOK.decode(r["input_ids"]).endswith("The answer is 5.<|endoftext|>"))
    prompt = (ALPACA_INPUT if inp else ALPACA_NO_INPUT).format(instruction=row["instruction"], input=inp)
    assert ex["input_ids"] == _ids(prompt) + _ids(row["output"]) + [EOS]
    assert ex["labels"] == [IGNORE] * len(_ids(prompt)) + _ids(row["output"]) + [EOS]


def test_train_on_prompt_trains_everything(tmp_path):
    built = _build(tmp_path, alpaca_rows(4), cfg={"train_on_prompt": True})
    assert all(r["labels"] == r["input_ids"] for r in _all(built))


CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Add 1 and 1"},
        {"role": "assistant", "content": "It is 2."}]


@pytest.mark.parametrize("template", ["alpaca", "plain", "chat"])
def test_multi_turn_trains_every_assistant_turn_only(tmp_path, template):
    rows = [{"messages": CONV}, {"messages": CONV[:3]}]
    built = _build(tmp_path, rows, template=template, sources=[{"path": "rows.jsonl", "format": "messages"}])
    ex = max(_all(built), key=lambda r: len(r["input_ids"]))
    trained = TOK.decode([i for i, lab in zip(ex["input_ids"], ex["labels"]) if lab != IGNORE])
    masked = TOK.decode([i for i, lab in zip(ex["input_ids"], ex["labels"]) if lab == IGNORE])
    assert "Hello!" in trained and "It is 2." in trained
    for text in ("Be brief.", "Hi there", "Add 1 and 1"):
        assert text in masked and text not in trained
    if template == "chat":
        assert TOK.decode(ex["input_ids"]) == TOK.apply_chat_template(CONV, tokenize=False) + "<|endoftext|>"
        assert trained == "Hello!<|im_end|>\nIt is 2.<|im_end|>\n<|endoftext|>"
    else:
        assert trained == "Hello!<|endoftext|>It is 2.<|endoftext|>"


def test_sharegpt_and_field_mapping(tmp_path):
    share = [{"conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}]}]
    dolly = [{"instruction": "Name a colour.", "context": "sky", "response": "Blue.", "category": "qa"}]
    write_rows(tmp_path / "share.json", share)
    write_rows(tmp_path / "dolly.csv", dolly)
    built = _build(tmp_path, sources=[{"path": "share.json", "format": "sharegpt"},
                                      {"path": "dolly.csv", "fields": {"input": "context", "output": "response"}}])
    texts = {TOK.decode(r["input_ids"]) for r in _all(built)}
    assert ALPACA_NO_INPUT.format(instruction="Q1") + "A1<|endoftext|>" in texts
    assert ALPACA_INPUT.format(instruction="Name a colour.", input="sky") + "Blue.<|endoftext|>" in texts


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet", ".csv"])
def test_local_file_types(tmp_path, suffix):
    built = _build(tmp_path, alpaca_rows(6), name=f"rows{suffix}")
    assert built.stats["sources"][0]["read"] == 6 and built.stats["examples"] == 6


def test_truncation_policies(tmp_path):
    long = {"instruction": "Say it.", "input": "", "output": "word " * 300}
    short = [{"instruction": f"Say {i}.", "input": "", "output": f"It is {i}."} for i in range(3)]
    cut = _build(tmp_path / "cut", [long, *short], cfg={"max_length": 90})
    lens = [len(r["input_ids"]) for r in _all(cut)]
    assert max(lens) == 90 and cut.stats["truncated"] == 1
    truncated = next(r for r in _all(cut) if len(r["input_ids"]) == 90)
    assert truncated["labels"][-1] != IGNORE and EOS not in truncated["input_ids"]  # cut from the right
    drop = _build(tmp_path / "drop", [long, *short], cfg={"max_length": 64, "truncation": "drop"})
    assert drop.stats["examples"] == 3 and drop.stats["sources"][0]["dropped"] == {"over_max_length": 1}
    # A prompt that fills the window leaves no reply token: dropped under either policy.
    huge = {"instruction": "word " * 300, "input": "", "output": "ok"}
    cut2 = _build(tmp_path / "cut2", [huge, *short], cfg={"max_length": 90})
    assert cut2.stats["sources"][0]["dropped"] == {"no_response_after_truncation": 1}


def test_filters(tmp_path):
    rows = alpaca_rows(6) + [{"instruction": "x", "input": "", "output": ""}]
    plain = _build(tmp_path / "plain", rows)
    lengths = sorted(len(r["input_ids"]) for r in _all(plain))
    assert plain.stats["sources"][0]["empty_response"] == 1 and len(lengths) == 6
    low, high = lengths[1], lengths[-2]
    built = _build(tmp_path / "filtered", rows, filters={"min_tokens": low, "max_tokens": high})
    st = built.stats["sources"][0]
    assert st["dropped"] == {"below_min_tokens": sum(n < low for n in lengths),
                             "above_max_tokens": sum(n > high for n in lengths)}
    assert sorted(len(r["input_ids"]) for r in _all(built)) == [n for n in lengths if low <= n <= high]
    kept = _build(tmp_path / "kept", rows, filters={"empty_response": False})  # then it trains EOS alone
    assert kept.stats["examples"] == 7
    assert [[x for x in r["labels"] if x != IGNORE] for r in _all(kept)].count([EOS]) == 1


def test_split_is_deterministic_by_seed(tmp_path):
    rows = alpaca_rows(40)
    a = _build(tmp_path / "a", rows, val_size=0.25, seed=1).datasets["validation"]["input_ids"]
    b = _build(tmp_path / "b", rows, val_size=0.25, seed=1).datasets["validation"]["input_ids"]
    c = _build(tmp_path / "c", rows, val_size=0.25, seed=2).datasets["validation"]["input_ids"]
    assert len(a) == 10 and a == b and a != c


def test_weights_scale_training_rows_only(tmp_path):
    write_rows(tmp_path / "a.jsonl", alpaca_rows(20, prefix="A "))
    write_rows(tmp_path / "b.jsonl", alpaca_rows(20, seed=1, prefix="B "))
    built = _build(tmp_path, sources=[{"path": "a.jsonl", "weight": 2.0}, {"path": "b.jsonl", "weight": 0.5}],
                   val_size=4)
    src = np.array(built.datasets["train"]["source"])
    a, b = built.stats["sources"]
    assert (src == 0).sum() == 2 * a["train"] and (src == 1).sum() == round(0.5 * b["train"])
    assert a["validation"] + b["validation"] == 4 == len(built.datasets["validation"])
    assert len(set(map(tuple, np.array(built.datasets["train"]["input_ids"], dtype=object)[src == 1]))) == \
        (src == 1).sum()  # a fraction samples without replacement


def test_exact_dedup_across_sources(tmp_path):
    rows = alpaca_rows(5)
    twin = [{**rows[0], "output": "  " + rows[0]["output"].upper() + " "}]
    write_rows(tmp_path / "a.jsonl", rows)
    write_rows(tmp_path / "b.jsonl", twin + alpaca_rows(3, seed=9, prefix="B "))
    built = _build(tmp_path, sources=[{"path": "a.jsonl"}, {"path": "b.jsonl"}])
    assert [s["duplicates_exact"] for s in built.stats["sources"]] == [0, 1]
    assert built.stats["duplicates_removed"] == {"exact": 1, "near": 0}


def test_cache_hit_and_invalidation(tmp_path):
    first = _build(tmp_path, alpaca_rows(8))
    again = _build(tmp_path)
    assert not first.cached and again.cached and again.path == first.path
    assert again.datasets["train"]["input_ids"] == first.datasets["train"]["input_ids"]
    changed = {
        "max_length": _build(tmp_path, cfg={"max_length": 200}),
        "template": _build(tmp_path, cfg={"template": "plain"}),
        "pack": _build(tmp_path, cfg={"pack": True}),
        "file": _build(tmp_path, alpaca_rows(9)),
    }
    paths = {k: b.path for k, b in changed.items()}
    assert first.path not in paths.values() and len(set(paths.values())) == 4
    assert not any(b.cached for b in changed.values())
    tok2 = tiny_tokenizer(chat=False)  # another chat template is another tokenizer
    path = tmp_path / "r.yaml"
    assert build_info(DataCfg(recipe=str(path), max_length=256), tok2, tmp_path / "cache").path != \
        _build(tmp_path, alpaca_rows(8)).path


def test_num_proc_gives_the_same_dataset(tmp_path, monkeypatch):
    from tunelab.data import tokenize as tk
    from tunelab.data.build import make
    from tunelab.data.recipe import load_recipe

    write_rows(tmp_path / "rows.jsonl", alpaca_rows(300))
    recipe, rp = load_recipe(str(write_recipe(tmp_path / "r.yaml", sources=[{"path": "rows.jsonl"}], val_size=10)))
    cfg = DataCfg(recipe=str(rp), max_length=128)
    monkeypatch.setattr(tk, "CHUNK", 50)  # six chunks, so two workers share the work
    one, _ = make(cfg, recipe, rp, TOK, num_proc=1)
    two, _ = make(cfg, recipe, rp, TOK, num_proc=2)
    for split in ("train", "validation"):
        assert one[split]["input_ids"] == two[split]["input_ids"]
        assert one[split]["labels"] == two[split]["labels"]


def test_generator_recipe_builds_with_the_old_signature(tmp_path):
    ds = build(DataCfg(recipe="arithmetic", max_length=128), TOK, tmp_path)
    assert len(ds["validation"]) == 64 and set(ds["train"].column_names) >= {"input_ids", "labels"}
    assert TEMPLATES["alpaca"].load().render({"instruction": "a", "input": "", "output": "b"}) == (
        ALPACA_NO_INPUT.format(instruction="a"), "b")


# Column layouts of the hub datasets the shipped recipes read, one row each; a shipped recipe whose
# hub id is missing here fails the test below, so every recipe is exercised on its real schema.
HUB_SCHEMAS = {
    "tatsu-lab/alpaca": lambda i: {"instruction": f"Give tip {i}.", "input": "" if i % 2 else f"ctx {i}",
                                   "output": f"Tip {i}: sleep well.", "text": "rendered prompt"},
    "vicgalle/alpaca-gpt4": lambda i: {"instruction": f"Explain {i}.", "input": "", "output": f"It is {i}.",
                                       "text": "rendered prompt"},
    "databricks/databricks-dolly-15k": lambda i: {"instruction": f"Who is {i}?", "context": f"{i} is a cat.",
                                                  "response": f"A cat named {i}.", "category": "closed_qa"},
    "HuggingFaceH4/ultrachat_200k": lambda i: {
        "prompt": f"Hello {i}", "prompt_id": str(i),
        "messages": [{"role": "user", "content": f"Hello {i}"}, {"role": "assistant", "content": f"Hi {i}!"},
                     {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "You're welcome."}]},
}


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO_ROOT / "data_recipes").glob("*.yaml")))
def test_shipped_recipes_build_on_local_copies(tmp_path, name):
    raw = yaml.safe_load((REPO_ROOT / "data_recipes" / f"{name}.yaml").read_text())
    for k, src in enumerate(raw["sources"]):
        if "hub" in src:
            hub = src.pop("hub")
            for key in ("config", "split", "revision"):
                src.pop(key, None)
            src["path"] = write_rows(tmp_path / f"src{k}.parquet", [HUB_SCHEMAS[hub](i) for i in range(60)]).name
            src.pop("limit", None)
    raw["val_size"] = 4
    path = write_recipe(tmp_path / f"{name}.yaml", **raw)
    built = build_info(DataCfg(recipe=str(path), max_length=256), TOK, tmp_path / "cache")
    assert len(built.datasets["validation"]) == 4 and len(built.datasets["train"]) > 0
    for st in built.stats["sources"]:
        assert st["examples"] > 0 and st["dropped"] == {}
    for r in built.datasets["train"].select(range(3)):
        assert any(x != IGNORE for x in r["labels"]) and any(x == IGNORE for x in r["labels"])


def test_tokenizing_reports_its_progress_to_the_end(tmp_path):
    """The bar of `exp data build` and of a cell's data stage: counts that only grow, the last at the total."""
    write_rows(tmp_path / "rows.jsonl", alpaca_rows(40))
    path = write_recipe(tmp_path / "r.yaml", sources=[{"path": "rows.jsonl"}], val_size=1)
    cfg, marks = DataCfg(recipe=str(path), max_length=256), []
    build_info(cfg, TOK, tmp_path / "cache", progress=lambda d, t: marks.append((d, t)))
    assert marks and [d for d, _ in marks] == sorted(d for d, _ in marks)
    assert marks[-1][0] == marks[-1][1] >= 40
    again = []  # a cache hit tokenizes nothing and says nothing
    build_info(cfg, TOK, tmp_path / "cache", progress=lambda d, t: again.append(d))
    assert again == []
