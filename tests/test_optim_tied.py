"""prepare_for_fused: a tied embedding's single gradient buffer gives the same LOMO/AdaLomo updates."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tunelab.optimizers import AdaLomo, Lomo
from tunelab.optimizers.tied import prepare_for_fused
from tunelab.train.data import label_tokens
from tunelab.train.loss import causal_lm_loss

STEPS = 3


def tiny_llama(tied: bool = True, pad: int | None = None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied, pad_token_id=pad)
    return LlamaForCausalLM(cfg)


def fixed_batch() -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    ids[0, :3] = ids[1, 5]  # repeated tokens: several rows add into one row of the shared weight
    ids[1, 0] = 0  # the padding token when the config has one
    labels = ids.clone()
    labels[:, :4] = -100
    return {"input_ids": ids, "labels": labels}


@torch.no_grad()
def max_param_diff(a, b) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def train(model, cls, precision: str = "fp32", loop_loss: bool = False, prepare: bool = False,
          **kw) -> list[float]:
    opt, batch = cls(model.parameters(), **kw), fixed_batch()
    if prepare:  # as the loop does: with the optimizer, so its clipping pass only measures the tied gradient
        assert prepare_for_fused(model, opt)

    def closure():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            if loop_loss:  # the training loop's: the head only at labelled positions
                return causal_lm_loss(model, batch, label_tokens(batch))
            return model(**batch).loss

    return [opt.fused_step(closure)[1] for _ in range(STEPS)]


CASES = {"plain": dict(lr=1e-2), "clipped+wd": dict(lr=1e-2, clip_grad_norm=0.05, weight_decay=0.1)}


@pytest.mark.parametrize("pad", [None, 0])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cls", [Lomo, AdaLomo])
def test_same_updates_as_plain_autograd(cls, case, pad):
    plain, prepared = tiny_llama(pad=pad), tiny_llama(pad=pad)
    start = copy.deepcopy(plain)
    want = train(plain, cls, **CASES[case])
    got = train(prepared, cls, prepare=True, **CASES[case])
    assert max_param_diff(plain, start) > 1e-3  # the weights moved
    assert max_param_diff(prepared, plain) < 1e-6
    assert got == pytest.approx(want, rel=1e-6)
    assert prepared.get_input_embeddings().weight is prepared.get_output_embeddings().weight


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("cls", [Lomo, AdaLomo])
def test_same_updates_with_the_loops_loss(cls, chunk, monkeypatch):
    """The loop's loss (the head and loss in chunks of `chunk` positions, train/chunked.py) with the tied
    weight's gradient built by the lookup from the chunks' factors, 10 vocabulary rows at a time (not a divisor
    of 64), in both the norm and the update pass: the updates of plain autograd on `model(**batch).loss`."""
    from tunelab.train.chunked import HeadFactors, set_chunk

    deferred = []  # the lookup's backward asked the chunked head's factors for blocks: the gradient was deferred
    monkeypatch.setattr(HeadFactors, "block_rows", lambda self: deferred.append(1) or 10)
    plain, prepared = tiny_llama(), tiny_llama()
    set_chunk(prepared.get_output_embeddings(), chunk)
    want = train(plain, cls, lr=1e-2, clip_grad_norm=0.05)
    got = train(prepared, cls, loop_loss=True, prepare=True, lr=1e-2, clip_grad_norm=0.05)
    assert len(deferred) == 2 * STEPS  # the norm pass and the update pass of every step
    assert max_param_diff(prepared, plain) < 1e-6
    assert got == pytest.approx(want, rel=1e-6)


def test_untied_model_is_left_alone():
    model = tiny_llama(tied=False)
    forwards = (model.get_input_embeddings().forward, model.get_output_embeddings().forward)
    assert not prepare_for_fused(model)
    assert (model.get_input_embeddings().forward, model.get_output_embeddings().forward) == forwards


@pytest.mark.parametrize("cls", [Lomo, AdaLomo])
def test_clipping_pass_measures_the_tied_gradient_in_blocks(cls, monkeypatch):
    """With the optimizer, the norm pass never builds the shared weight's gradient: it adds its squared norm,
    block by block (10 rows, not a divisor of the 64-row vocabulary), and the updates stay the same."""
    from tunelab.optimizers import tied

    monkeypatch.setattr(tied, "CHUNK_ROWS", 10)
    measured = []
    monkeypatch.setattr(cls, "add_sq_norm", lambda self, sq, f=cls.add_sq_norm: (measured.append(sq), f(self, sq)))
    plain, prepared = tiny_llama(), tiny_llama()
    want = train(plain, cls, lr=1e-2, clip_grad_norm=0.05)
    got = train(prepared, cls, prepare=True, lr=1e-2, clip_grad_norm=0.05)
    assert len(measured) == STEPS  # once per step: in the norm pass only
    assert got == pytest.approx(want, rel=1e-6)
    assert max_param_diff(prepared, plain) < 1e-6
