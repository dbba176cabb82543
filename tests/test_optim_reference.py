"""Lion, Adan, SophiaG and Muon+AdamW against their papers' update rules or official implementations."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_optim_lomo import fixed_batch, max_param_diff
from transformers import LlamaConfig, LlamaForCausalLM

from tunelab.optimizers import Adan, Lion, MuonAdamW, SophiaG
from tunelab.optimizers.muon import split_hidden

P0 = [0.5, -1.0, 2.0]
A = [1.0, 3.0, 0.5]  # loss = sum(a * p^2 / 2 + b * p): gradient a * p + b, different per coordinate
B = [0.1, -0.2, 0.3]


def grads_of(p: list[float]) -> list[float]:
    return [a * x + b for a, x, b in zip(A, p, B)]


def run_torch(opt_cls, steps: int, **kw) -> list[float]:
    p = torch.tensor(P0, dtype=torch.float64, requires_grad=True)
    opt = opt_cls([p], **kw)
    a, b = torch.tensor(A, dtype=torch.float64), torch.tensor(B, dtype=torch.float64)
    for _ in range(steps):
        opt.zero_grad()
        (a * p * p / 2 + b * p).sum().backward()
        opt.step()
    return p.tolist()


def sign(x: float) -> float:
    return (x > 0) - (x < 0)


def test_lion_follows_program_1_of_the_paper():
    lr, b1, b2, wd = 0.01, 0.9, 0.99, 0.1
    p, m = list(P0), [0.0] * 3
    for _ in range(4):
        g = grads_of(p)
        c = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
        p = [pi - lr * (sign(ci) + wd * pi) for pi, ci in zip(p, c)]
        m = [b2 * mi + (1 - b2) * gi for mi, gi in zip(m, g)]
    assert run_torch(Lion, 4, lr=lr, betas=(b1, b2), weight_decay=wd) == pytest.approx(p, abs=1e-12)


@pytest.mark.parametrize("no_prox", [False, True])
def test_adan_follows_algorithm_1_of_the_paper(no_prox):
    # The paper's notation: small betas weigh the new value (m = (1 - b1) m + b1 g), g_0 = g_1.
    lr, eps, wd = 0.01, 1e-8, 0.02
    b1, b2, b3 = 0.02, 0.08, 0.01
    p = list(P0)
    m, v, n = [0.0] * 3, [0.0] * 3, [0.0] * 3
    prev = None
    for k in range(1, 5):
        g = grads_of(p)
        prev = g if prev is None else prev
        d = [gi - qi for gi, qi in zip(g, prev)]
        m = [(1 - b1) * mi + b1 * gi for mi, gi in zip(m, g)]
        v = [(1 - b2) * vi + b2 * di for vi, di in zip(v, d)]
        n = [(1 - b3) * ni + b3 * (gi + (1 - b2) * di) ** 2 for ni, gi, di in zip(n, g, d)]
        c1, c2, c3 = (1 - (1 - b) ** k for b in (b1, b2, b3))  # bias corrections
        step = [lr * (mi / c1 + (1 - b2) * vi / c2) / (math.sqrt(ni / c3) + eps) for mi, vi, ni in zip(m, v, n)]
        if no_prox:
            p = [pi * (1 - lr * wd) - si for pi, si in zip(p, step)]
        else:
            p = [(pi - si) / (1 + lr * wd) for pi, si in zip(p, step)]
        prev = g
    got = run_torch(Adan, 4, lr=lr, betas=(1 - b1, 1 - b2, 1 - b3), eps=eps, weight_decay=wd, no_prox=no_prox)
    assert got == pytest.approx(p, abs=1e-12)


def small_llama(vocab: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64, tie_word_embeddings=False))


def test_sophiag_matches_the_official_implementation():
    """tunelab's SophiaG with its Hessian refresh in after_step equals the authors' SophiaG (sophia-opt)
    driven as their training script drives it, with labels sampled from the model at the same positions."""
    from sophia_opt import SophiaG as Official

    k, lr, rho, wd = 2, 1e-2, 0.04, 0.1
    ours, ref = small_llama(), small_llama()
    start = copy.deepcopy(ours)
    batch = fixed_batch()
    mask = batch["labels"][:, 1:] != -100
    n = int(mask.sum())
    opt = SophiaG(ours.parameters(), lr=lr, rho=rho, weight_decay=wd, hessian_interval=k)
    off = Official(ref.parameters(), lr=lr, rho=rho, weight_decay=wd)
    for step in range(1, 6):
        ours(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        torch.manual_seed(100 + step)
        opt.after_step(step=step, model=ours, batch=batch)

        ref(**batch).loss.backward()
        off.step(bs=n)
        off.zero_grad()
        if step % k == 0:
            torch.manual_seed(100 + step)
            logits = ref(input_ids=batch["input_ids"]).logits[:, :-1][mask]
            sampled = torch.distributions.Categorical(logits=logits.detach()).sample()
            torch.nn.functional.cross_entropy(logits, sampled).backward()
            off.update_hessian()
            off.zero_grad()
    hess = [s["hessian"] for s in opt.state.values()]
    assert all(torch.isfinite(h).all() for h in hess) and any(float(h.abs().max()) > 0 for h in hess)
    assert max_param_diff(ours, start) > 1e-3
    assert max_param_diff(ours, ref) < 1e-6


def test_sophiag_refreshes_the_hessian_every_k_steps_only():
    model, batch = small_llama(), fixed_batch()
    opt = SophiaG(model.parameters(), hessian_interval=3)
    model(**batch).loss.backward()
    opt.step()
    snapshots = []
    for step in range(1, 7):
        opt.after_step(step=step, model=model, batch=batch)
        snapshots.append([s["hessian"].clone() for s in opt.state.values()])
    changed = [any(not torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip([snapshots[0]] + snapshots, snapshots)]
    assert changed == [False, False, True, False, False, True]
    assert all(p.grad is not None for p in model.parameters())  # training gradients untouched


@pytest.mark.parametrize("named", [True, False])
def test_muon_takes_hidden_matrices_and_adamw_the_rest(named):
    model = small_llama(vocab=128)  # vocabulary larger than every hidden dimension, as in real models
    params = list(model.named_parameters()) if named else list(model.parameters())
    muon, rest = split_hidden(params)
    by_id = {id(p): n for n, p in model.named_parameters()}
    assert sorted(by_id[id(p)] for p in rest) == sorted(
        n for n, p in model.named_parameters() if p.ndim != 2 or "embed" in n or "lm_head" in n)
    assert muon and all("proj" in by_id[id(p)] for p in muon)


def test_muon_adamw_equals_its_two_halves_under_a_schedule():
    ours, ref = small_llama(vocab=128), small_llama(vocab=128)
    batch = fixed_batch()
    opt = MuonAdamW(list(ours.named_parameters()), lr=1e-2, weight_decay=0.01)
    hidden, rest = split_hidden(list(ref.named_parameters()))
    parts = [torch.optim.Muon(hidden, lr=1e-2, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
             torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.01)]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1)) for o in (opt, *parts)]
    for _ in range(3):
        ours(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        ref(**batch).loss.backward()
        for o in parts:
            o.step()
            o.zero_grad()
        for s in scheds:
            s.step()
    assert max_param_diff(ours, ref) < 1e-6
    fresh = MuonAdamW(list(small_llama(vocab=128).named_parameters()), lr=1e-2)
    fresh.load_state_dict(opt.state_dict())
    assert [g["lr"] for g in fresh.param_groups] == [g["lr"] for g in opt.param_groups] == [1e-2 / 4] * 2
