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


def deferred_blocks(monkeypatch) -> list[int]:
    """Counts the blocks a plain head call's factors built the tied gradient from (`_Product.block`): only the
    prepared path builds it so, so a test that sees none compared plain autograd with itself."""
    from tunelab.optimizers import tied

    built: list[int] = []
    monkeypatch.setattr(tied._Product, "block", lambda self, a, b, f=tied._Product.block: (built.append(b - a),
                                                                                          f(self, a, b))[1])
    return built


@pytest.mark.parametrize("reentrant", [False, True])
def test_same_updates_with_gradient_checkpointing(reentrant, monkeypatch):
    built = deferred_blocks(monkeypatch)
    plain, prepared = tiny_llama(), tiny_llama()
    prepared.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    prepared.train()
    train(plain, AdaLomo, lr=1e-2, clip_grad_norm=0.05)
    assert not built
    train(prepared, AdaLomo, prepare=True, lr=1e-2, clip_grad_norm=0.05)
    assert built  # the recomputed forward still deferred the head's gradient to the lookup
    assert max_param_diff(prepared, plain) < 1e-6


@pytest.mark.parametrize("cls", [Lomo, AdaLomo])
def test_same_updates_under_bf16_autocast(cls, monkeypatch):
    """The prepared (fused) path under bf16 autocast against plain autograd under the same autocast."""
    built = deferred_blocks(monkeypatch)
    plain, prepared = tiny_llama(), tiny_llama()
    start = copy.deepcopy(plain)
    want = train(plain, cls, "bf16", lr=1e-2, clip_grad_norm=1.0)
    assert not built
    got = train(prepared, cls, "bf16", prepare=True, lr=1e-2, clip_grad_norm=1.0)
    assert built
    assert max_param_diff(plain, start) > 1e-3
    # The same bf16 products; the head's gradient is one bf16 matmul in either order of operands.
    assert max_param_diff(prepared, plain) < 1e-5
    assert got == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("cls", [Lomo, AdaLomo])
def test_same_updates_with_bf16_weights(cls, monkeypatch):
    built = deferred_blocks(monkeypatch)
    plain, prepared = tiny_llama().to(torch.bfloat16), tiny_llama().to(torch.bfloat16)
    train(plain, cls, lr=1e-2, clip_grad_norm=0.05)
    train(prepared, cls, prepare=True, lr=1e-2, clip_grad_norm=0.05)
    assert built
    # bf16 sums in another order can differ by an ulp, which may flip a weight's rounding (2^-7 near 1).
    assert max_param_diff(prepared, plain) <= 2 ** -7


def test_a_pass_that_skips_the_lookup_leaves_nothing_behind(monkeypatch):
    """autograd.grad up to the hidden states runs the head's backward but not the lookup's: the next
    backward of the same graph must not count that pass's part of the weight's gradient."""
    built = deferred_blocks(monkeypatch)
    plain, prepared = tiny_llama(), tiny_llama()
    assert prepare_for_fused(prepared)
    batch = fixed_batch()
    for m in (plain, prepared):
        out = m(**batch, output_hidden_states=True)
        torch.autograd.grad(out.loss, out.hidden_states[-1], retain_graph=True)
        out.loss.backward()
    assert built
    for p, q in zip(plain.parameters(), prepared.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7)


def test_forward_and_gradients_unchanged(monkeypatch):
    built = deferred_blocks(monkeypatch)
    plain, prepared = tiny_llama(), tiny_llama()
    assert prepare_for_fused(prepared)
    batch = fixed_batch()
    a, b = plain(**batch), prepared(**batch)
    assert torch.equal(a.logits, b.logits)
    a.loss.backward()
    b.loss.backward()
    assert built
    for (name, p), q in zip(plain.named_parameters(), prepared.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=name)
    with torch.no_grad():  # evaluation and generation take the plain path
        assert torch.equal(plain(**batch).logits, prepared(**batch).logits)


def test_inputs_embeds_without_lookup_still_get_the_head_gradient():
    plain, prepared = tiny_llama(), tiny_llama()
    assert prepare_for_fused(prepared)
    ids = fixed_batch()["input_ids"]
    for m in (plain, prepared):
        embeds = m.get_input_embeddings()(ids).detach()
        m(inputs_embeds=embeds, labels=ids).loss.backward()
    w_plain, w_prep = plain.get_output_embeddings().weight, prepared.get_output_embeddings().weight
    assert w_prep.grad is not None
    torch.testing.assert_close(w_prep.grad, w_plain.grad, rtol=1e-6, atol=1e-7)


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
