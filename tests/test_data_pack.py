"""Packing: rows hold several examples, positions restart per example, and losses do not change."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_data_util import alpaca_rows, tiny_tokenizer, write_recipe, write_rows
from transformers import LlamaConfig, LlamaForCausalLM

from tunelab.core.config import CellConfig, DataCfg
from tunelab.data.build import build
from tunelab.data.pack import best_fit_decreasing
from tunelab.train.data import IGNORE, batch_tokens, block_causal_mask, label_tokens, loader


def tiny_llama(vocab: int, attn: str = "sdpa"):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn)
    return LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("pack")
    write_rows(d / "rows.jsonl", alpaca_rows(14))
    recipe = write_recipe(d / "r.yaml", sources=[{"path": "rows.jsonl"}], val_size=2)
    tok = tiny_tokenizer()
    built = {p: build(DataCfg(recipe=str(recipe), max_length=256, pack=p), tok, d / "cache") for p in (False, True)}
    return recipe, tok, built


def test_best_fit_decreasing_fills_rows_without_overflow():
    lengths = np.array([60, 50, 40, 30, 20, 10, 90, 5])
    rows = best_fit_decreasing(lengths, 100)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(lengths[r].sum() <= 100 for r in rows)
    assert len(rows) == 4  # 305 tokens: 4 rows is the least possible


def test_packed_rows_hold_the_same_examples(data):
    _, _, built = data
    plain, packed = built[False]["train"], built[True]["train"]
    assert len(packed) < len(plain)
    examples = sorted(tuple(r["input_ids"]) for r in plain)
    found, trained = [], 0
    for row in packed:
        ids, pos, labels = row["input_ids"], np.array(row["position_ids"]), row["labels"]
        assert len(ids) <= 256
        starts = list(np.flatnonzero(pos == 0)) + [len(ids)]
        for a, b in zip(starts, starts[1:]):
            assert list(pos[a:b]) == list(range(b - a))  # positions restart per example
            assert labels[a] == IGNORE  # no example predicts the start of the next one
            found.append(tuple(ids[a:b]))
        trained += sum(x != IGNORE for x in labels)
    assert sorted(found) == examples
    assert trained == sum(sum(x != IGNORE for x in r["labels"][1:]) for r in plain)


def test_block_causal_mask_isolates_examples():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    allowed = block_causal_mask(pos)[0, 0] == 0
    expect = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                           [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(allowed, expect)


def _summed_loss(model, ds, pad_id: int) -> tuple[float, int, int]:
    total, n, tokens = 0.0, 0, 0
    for b in loader(ds, 4, pad_id, shuffle=False):
        k = label_tokens(b)
        with torch.no_grad():
            total += float(model(**b, num_items_in_batch=torch.tensor(k)).loss.double()) * k
        n, tokens = n + k, tokens + batch_tokens(b)
    return total / n, n, tokens


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_equals_unpacked_loss(data, attn):
    _, tok, built = data
    model = tiny_llama(len(tok), attn).eval()
    plain = _summed_loss(model, built[False]["train"], tok.pad_token_id)
    packed = _summed_loss(model, built[True]["train"], tok.pad_token_id)
    assert plain[1:] == packed[1:]  # same trained tokens, same real tokens
    assert abs(plain[0] - packed[0]) < 1e-5, (plain, packed)


def test_training_loop_losses_match_packed_and_unpacked(data, tmp_path):
    """The loop, on a batch that holds the whole training set each step, packed or not."""
    from tunelab.train.loop import run
    from tunelab.train.validation import Validation

    recipe, tok, built = data
    losses = {}
    for pack in (False, True):
        ds = built[pack]
        cfg = CellConfig.model_validate({
            "model": {"name": "tiny-random-llama"}, "data": {"recipe": str(recipe), "pack": pack},
            "optim": {"name": "adamw", "lr": 1e-3},
            "train": {"steps": 3, "batch_size": len(ds["train"]), "save_final": False, "seed": 0},
            "eval": {"tasks": ["val_loss"]}, "tracking": {"wandb": False}})
        out = tmp_path / str(pack)
        result = run(tiny_llama(len(tok)), tok, ds, cfg, out, validation=Validation.of(cfg.eval))
        steps = [json.loads(x)["loss"] for x in (out / "train" / "metrics.jsonl").read_text().splitlines()]
        losses[pack] = steps + [result.val_loss]
    assert np.allclose(losses[True], losses[False], atol=1e-5, rtol=0), losses
    assert losses[False][0] > losses[False][2]  # it did train
