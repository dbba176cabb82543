"""Packed rows attended example by example (train/segments.py): the same losses and gradients as the
block-diagonal mask, the loop takes that path in one process on CPU, and models it cannot serve keep the mask."""

from __future__ import annotations

import pytest
import torch
from test_data_pack import data, tiny_llama  # noqa: F401 - the module-scoped packed dataset fixture

from tunelab.train import segments
from tunelab.train.data import collate_packed, label_tokens
from tunelab.train.loss import causal_lm_loss


def _loss_and_grads(model, batch: dict) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss(model, batch, label_tokens(batch))
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]


def test_attention_by_example_equals_the_block_mask(data):  # noqa: F811
    _, tok, built = data
    rows = list(built[True]["train"].with_format(None))[:3]
    model = tiny_llama(len(tok)).train()
    masked = collate_packed(tok.pad_token_id)(rows)  # (rows, L) with a (rows, 1, L, L) block mask
    flat = collate_packed(tok.pad_token_id, varlen=True)(rows)  # one row, no padding, no mask
    assert masked["input_ids"].shape[0] == 3 and flat["input_ids"].shape[0] == 1 and "attention_mask" not in flat
    want = _loss_and_grads(model, masked)
    assert segments.usable(model)
    with segments.attending_by_example(model):
        got = _loss_and_grads(model, flat)
    assert model.config._attn_implementation == "sdpa"  # restored
    assert got[0] == pytest.approx(want[0], abs=1e-6)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)


def test_the_loop_attends_packed_rows_by_example(data, tmp_path, monkeypatch):  # noqa: F811
    """tests/test_data_pack.py checks the loop's packed losses against unpacked ones; here: that it took this path."""
    from tunelab.config import CellConfig
    from tunelab.train.loop import run

    recipe, tok, built = data
    seen: list[int] = []
    inner = segments._attention

    def spy(module, query, *args, **kwargs):
        seen.append(query.shape[0])
        return inner(module, query, *args, **kwargs)

    monkeypatch.setattr(segments, "_attention", spy)
    segments._register.cache_clear()
    cfg = CellConfig.model_validate({
        "model": {"name": "tiny-random-llama"}, "data": {"recipe": str(recipe), "pack": True},
        "train": {"steps": 2, "batch_size": 2, "save_final": False}, "eval": {"tasks": []},
        "tracking": {"wandb": False}})
    model = tiny_llama(len(tok))
    try:
        run(model, tok, built[True], cfg, tmp_path)
    finally:
        segments._register.cache_clear()
    assert len(seen) == 3 * model.config.num_hidden_layers  # the check's forward, then 2 steps
    assert set(seen) == {1}  # one flattened row per step
    assert model.config._attn_implementation == "sdpa"


def test_models_it_cannot_serve_keep_the_mask():
    from transformers import MistralConfig, MistralForCausalLM

    assert not segments.usable(tiny_llama(64, "eager"))
    torch.manual_seed(0)
    windowed = MistralForCausalLM(MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=3, attn_implementation="sdpa"))
    assert not segments.usable(windowed)  # each example would see past its window: the check's logits differ
    assert windowed.config._attn_implementation == "sdpa"
