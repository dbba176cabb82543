"""LOMO and AdaLomo: updates inside backward, equal to the official lomo-optim package's updates."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tunelab.optimizers import AdaLomo, Lomo

STEPS = 3


def tiny_llama(tied: bool = False, dtype=torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).to(dtype)


def fixed_batch(device="cpu") -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100  # a masked prompt, as the data layer makes
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


@torch.no_grad()
def max_param_diff(a, b) -> float:
    return max(float((p.float() - q.float()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def run_tunelab(model, cls, batch, **kw) -> list[float]:
    opt = cls(model.parameters(), **kw)
    norms = []
    for _ in range(STEPS):
        _, norm = opt.fused_step(lambda: model(**batch).loss)
        norms.append(norm)
    return norms


def run_official(model, name, batch, lr, clip, weight_decay):
    import lomo_optim

    opt = getattr(lomo_optim, name)(model, lr=lr, clip_grad_norm=clip, weight_decay=weight_decay)
    for _ in range(STEPS):
        loss = model(**batch).loss
        if clip is not None:
            opt.grad_norm(loss)
        opt.fused_backward(loss, lr)


@pytest.fixture
def no_cuda_call(monkeypatch):
    # lomo-optim's AdaLomo allocates its state with .cuda(); make that a no-op on a CPU-only machine.
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)


CASES = {"plain": (None, 0.0), "clipped+wd": (0.05, 0.1)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name,cls,lr", [("Lomo", Lomo, 5e-2), ("AdaLomo", AdaLomo, 1e-2)])
def test_matches_lomo_optim(name, cls, lr, case, no_cuda_call):
    clip, wd = CASES[case]
    ours, official = tiny_llama(), tiny_llama()
    start = copy.deepcopy(ours)
    batch = fixed_batch()
    norms = run_tunelab(ours, cls, batch, lr=lr, clip_grad_norm=clip, weight_decay=wd)
    run_official(official, name, batch, lr, clip, wd)
    assert max_param_diff(ours, start) > 1e-3  # the optimizers did move the weights
    assert max_param_diff(ours, official) < 1e-6
    if clip is not None:
        assert norms[0] > clip  # so clipping was active, not a no-op


@pytest.mark.parametrize("name,cls,lr", [("Lomo", Lomo, 5e-2), ("AdaLomo", AdaLomo, 1e-2)])
def test_bf16_matches_lomo_optim(name, cls, lr, no_cuda_call):
    ours, official = tiny_llama(dtype=torch.bfloat16), tiny_llama(dtype=torch.bfloat16)
    start = copy.deepcopy(ours)
    batch = fixed_batch()
    run_tunelab(ours, cls, batch, lr=lr, clip_grad_norm=1.0)
    run_official(official, name, batch, lr, 1.0, 0.0)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    assert max_param_diff(ours, start) > 1e-3
    # Same fp32 math rounded to bf16: equal except where an fp32 difference of an ulp flips a rounding
    # (one bf16 ulp is 2^-7 for weights near 1), which happens to a handful of elements at most.
    assert max_param_diff(ours, official) <= 2 ** -7
    differing = sum(int((p != q).sum()) for p, q in zip(ours.parameters(), official.parameters()))
    assert differing <= 1e-3 * sum(p.numel() for p in ours.parameters())


def test_lomo_is_sgd_on_tied_weights_with_a_schedule():
    """LOMO without clipping is SGD with decoupled weight decay, also when a weight is used twice
    (tied embeddings) and when an LR scheduler drives the learning rate."""
    ours, ref = tiny_llama(tied=True), tiny_llama(tied=True)
    batch = fixed_batch()
    lomo = Lomo(ours.parameters(), lr=0.1, weight_decay=0.01)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1, weight_decay=0.01)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1)) for o in (lomo, sgd)]
    for _ in range(STEPS):
        _, norm = lomo.fused_step(lambda: ours(**batch).loss)
        ref(**batch).loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
        sgd.step()
        sgd.zero_grad()
        for s in scheds:
            s.step()
        assert norm == pytest.approx(float(ref_norm), rel=1e-5)
    assert max_param_diff(ours, ref) < 1e-6


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("cls", [Lomo, AdaLomo])
def test_same_updates_with_gradient_checkpointing(cls, reentrant):
    plain, ckpt = tiny_llama(tied=True), tiny_llama(tied=True)
    ckpt.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    plain.train(), ckpt.train()
    batch = fixed_batch()
    run_tunelab(plain, cls, batch, lr=1e-2, clip_grad_norm=0.05)
    run_tunelab(ckpt, cls, batch, lr=1e-2, clip_grad_norm=0.05)
    assert max_param_diff(plain, ckpt) < 1e-6


@pytest.mark.parametrize("cls", [Lomo, AdaLomo])
def test_gradients_are_freed_one_by_one(cls):
    """At no time during the fused backward do two parameters hold a gradient."""
    model, batch = tiny_llama(), fixed_batch()
    params = list(model.parameters())
    alive = []
    # Registered before the optimizer's hooks, so these run first and see the gradient just completed.
    for p in params:
        p.register_post_accumulate_grad_hook(lambda _: alive.append(sum(q.grad is not None for q in params)))
    opt = cls(params, lr=1e-3, clip_grad_norm=1.0)
    opt.fused_step(lambda: model(**batch).loss)
    assert len(alive) == 2 * len(params)  # two passes (norm, then update), every parameter in each
    assert max(alive) == 1
    assert all(p.grad is None for p in params)


def test_adalomo_state_is_factored():
    model = tiny_llama()
    opt = AdaLomo(model.parameters(), lr=1e-3)
    opt.fused_step(lambda: model(**fixed_batch()).loss)
    state_numel = sum(t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    weights = sum(p.numel() for p in model.parameters())
    matrices = [p for p in model.parameters() if p.dim() == 2]
    assert state_numel == sum(sum(p.shape) for p in matrices) + sum(
        p.numel() for p in model.parameters() if p.dim() == 1)
    assert state_numel < weights / 10  # nothing like AdamW's two moments (2x the weights)
    assert not Lomo(tiny_llama().parameters()).state  # LOMO keeps no state at all


def test_backward_outside_fused_step_is_left_alone():
    model = tiny_llama()
    before = copy.deepcopy(model)
    Lomo(model.parameters(), lr=1.0)
    model(**fixed_batch()).loss.backward()
    assert max_param_diff(model, before) == 0.0
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("cls", [Lomo, AdaLomo])
def test_step_after_backward_equals_the_fused_step(cls):
    """Engines that run backward themselves (pipeline schedules) call step(grad_norm=...) afterwards: the
    same clipped update, from the accumulated gradients, each freed once used."""
    fused, plain = tiny_llama(), tiny_llama()
    norms = run_tunelab(fused, cls, fixed_batch(), lr=1e-2, clip_grad_norm=0.05)
    opt = cls(plain.parameters(), lr=1e-2, clip_grad_norm=0.05)
    for want in norms:
        plain(**fixed_batch()).loss.backward()
        opt.step()  # the norm over its own gradients when no grad_norm is given
        assert opt.last_grad_norm == pytest.approx(want, rel=1e-6)
        assert all(p.grad is None for p in plain.parameters())
    assert max_param_diff(fused, plain) < 1e-6
    assert any(n > 0.05 for n in norms)  # so the clipping was exercised


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,cls,lr", [("Lomo", Lomo, 5e-2), ("AdaLomo", AdaLomo, 1e-2)])
def test_matches_lomo_optim_on_cuda(name, cls, lr, dtype):
    ours, official = tiny_llama(dtype=dtype).cuda(), tiny_llama(dtype=dtype).cuda()
    batch = fixed_batch("cuda")
    run_tunelab(ours, cls, batch, lr=lr, clip_grad_norm=0.05)
    run_official(official, name, batch, lr, 0.05, 0.0)
    assert max_param_diff(ours, official) <= (1e-6 if dtype == torch.float32 else 2 ** -7)
