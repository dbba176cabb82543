"""The one-process loop's fast paths compute what the plain paths compute: packed rows attended example by
example (train/segments.py: the block-diagonal mask's losses and gradients; models it cannot serve keep the
mask), short attention in fp32 under CPU bf16 autocast (train/cpu_attention.py), a tied embedding's gradient
in one buffer (optimizers/tied.py) under AdamW, torch's fused AdamW."""

from __future__ import annotations

import pytest
import torch
from test_data_pack import data, tiny_llama  # noqa: F401 - the module-scoped packed dataset fixture

from tunelab.train import cpu_attention, optim, segments
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
    from tunelab.core.config import CellConfig
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


def _tied_run(built_data, tmp_path, name: str) -> tuple[list[dict], object]:
    from tunelab.core.config import CellConfig
    from tunelab.core.files import read_jsonl
    from tunelab.train.loop import run

    recipe, tok, built = built_data
    cfg = CellConfig.model_validate({
        "model": {"name": "tiny-random-llama"}, "data": {"recipe": str(recipe)},
        "optim": {"name": "adamw", "lr": 1e-2}, "train": {"steps": 3, "batch_size": 4, "save_final": False},
        "eval": {"tasks": []}, "tracking": {"wandb": False}})
    model = tiny_llama(len(tok))
    model.config.tie_word_embeddings = True
    model.tie_weights()
    run(model, tok, built[False], cfg, tmp_path / name)
    return read_jsonl(tmp_path / name / "train" / "metrics.jsonl"), model


def test_adamw_with_a_tied_embedding_in_one_buffer(data, tmp_path, monkeypatch):  # noqa: F811
    fast, model = _tied_run(data, tmp_path, "one-buffer")
    assert model.get_input_embeddings().forward.__name__ == "lookup"  # the loop prepared it (tied.py)
    monkeypatch.setattr("tunelab.train.loop.prepare_for_fused", lambda m: False)
    plain, model = _tied_run(data, tmp_path, "plain")
    assert model.get_input_embeddings().forward.__name__ == "forward"
    assert [r["loss"] for r in fast] == pytest.approx([r["loss"] for r in plain], abs=1e-6)
    assert [r["grad_norm"] for r in fast] == pytest.approx([r["grad_norm"] for r in plain], rel=1e-5)
    assert fast[0]["loss"] > fast[-1]["loss"]


def test_adam_and_adamw_take_the_fused_kernel_unless_told_otherwise():
    from tunelab.core.config import OptimCfg

    params = list(tiny_llama(64).parameters())
    assert optim.build(params, OptimCfg(name="adamw"), fused_kernel=True).defaults["fused"] is True
    assert optim.build(params, OptimCfg(name="adam"), fused_kernel=True).defaults["fused"] is True
    assert not optim.build(params, OptimCfg(name="adamw")).defaults["fused"]  # engines: as it was
    told = optim.build(params, OptimCfg(name="adamw", kwargs={"foreach": True}), fused_kernel=True)
    assert not told.defaults["fused"] and told.defaults["foreach"]
    assert "fused" not in optim.build(params, OptimCfg(name="lion"), fused_kernel=True).defaults


def _qkv(keys: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, keys, 16, generator=gen) for h in (4, 2, 2))
    return q, k, v.bfloat16()  # as under autocast: rotated q and k in fp32, v from a bf16 projection


def test_short_attention_runs_in_fp32_under_cpu_autocast():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as plain

    attn = tiny_llama(64).model.layers[0].self_attn  # its key/value groups and causality, as the model calls it
    q, k, v = _qkv(17)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = cpu_attention.sdpa(attn, q, k, v, None)[0]
        autocast_bf16 = plain(attn, q, k, v, None)[0]
    fp32 = plain(attn, q, k, v.float(), None)[0]
    assert got.dtype == torch.bfloat16 and autocast_bf16.dtype == torch.bfloat16
    assert torch.equal(got, fp32.bfloat16())  # computed in fp32, rounded once
    assert not torch.equal(got, autocast_bf16)
    q, k, v = _qkv(cpu_attention.SHORT_KEYS)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # long enough: autocast's bf16 kernel, as without the swap
        assert torch.equal(cpu_attention.sdpa(attn, q, k, v, None)[0], plain(attn, q, k, v, None)[0])
    v = v.float()  # no autocast: as it comes
    assert torch.equal(cpu_attention.sdpa(attn, q, k, v, None)[0], plain(attn, q, k, v, None)[0])


def test_the_loop_attends_in_fp32_in_a_cpu_bf16_step(data, tmp_path, monkeypatch):  # noqa: F811
    from transformers.integrations import sdpa_attention

    from tunelab.core.config import CellConfig
    from tunelab.core.files import read_jsonl
    from tunelab.train.loop import run

    recipe, tok, built = data
    inner, seen = sdpa_attention.sdpa_attention_forward, []

    def spy(module, query, key, value, *args, **kwargs):
        seen.append((torch.is_autocast_enabled("cpu"), value.dtype))
        return inner(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", spy)
    model = tiny_llama(len(tok))
    cfg = CellConfig.model_validate({
        "model": {"name": "tiny-random-llama"}, "data": {"recipe": str(recipe)},
        "train": {"steps": 2, "batch_size": 4, "precision": "bf16", "save_final": False}, "eval": {"tasks": []},
        "tracking": {"wandb": False}})
    assert cpu_attention.usable(model) and not cpu_attention.usable(tiny_llama(64, "eager"))
    seen.clear()  # the check's forward through the swap
    run(model, tok, built[False], cfg, tmp_path / "fp32-attention")
    assert model.config._attn_implementation == "sdpa"  # restored
    layers = model.config.num_hidden_layers
    assert len(seen) == 2 * layers and all(not on and dt == torch.float32 for on, dt in seen)
    seen.clear()
    monkeypatch.setattr(cpu_attention, "usable", lambda m: False)
    run(tiny_llama(len(tok)), tok, built[False], cfg, tmp_path / "bf16-attention")
    assert seen == []  # the model's own SDPA, in autocast's bf16
    fast, plain = (read_jsonl(tmp_path / n / "train" / "metrics.jsonl") for n in ("fp32-attention", "bf16-attention"))
    assert [r["loss"] for r in fast] == pytest.approx([r["loss"] for r in plain], rel=2e-2)  # bf16 rounding apart
