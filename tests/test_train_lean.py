"""train/lean.py: the lean RMSNorm and SiLU-gated MLP give the modules' own forward bit for bit, their gradients
within 1e-6 (fp32), through LoRA and under bf16 autocast, and keep exactly 2h + i fewer values a token and layer
for backward; evaluation (no gradients) runs the modules' own code."""

from __future__ import annotations

import copy

import pytest
import torch
from test_train_loss import padded_batch  # noqa: E402 - the shared tiny batch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tunelab.core.config import PeftCfg
from tunelab.train import lean, peft
from tunelab.train.data import label_tokens
from tunelab.train.loss import causal_lm_loss

H, INTER, LAYERS = 32, 64, 2


def tiny(family: str = "llama", dtype=torch.float32):
    torch.manual_seed(0)
    kw = dict(vocab_size=97, hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
    model = LlamaForCausalLM(LlamaConfig(**kw)) if family == "llama" else Qwen2ForCausalLM(Qwen2Config(**kw))
    with torch.no_grad():  # norm weights away from 1, so that the weight's product matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.to(dtype).train()


def run(model, batch, autocast: bool = False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(**{k: v for k, v in batch.items() if k != "labels"})
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), batch["labels"].flatten(),
                                                 ignore_index=-100)
    loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_forward_bit_for_bit_and_gradients_within_1e_6(family):
    plain = tiny(family)
    model = copy.deepcopy(plain)
    assert lean.apply(model) == 2 * LAYERS + 1 + LAYERS  # two norms a layer, the final norm, one MLP a layer
    assert lean.apply(model) == 0  # idempotent
    batch = padded_batch()
    logits_p, grads_p = run(plain, batch)
    logits_l, grads_l = run(model, batch)
    assert torch.equal(logits_p, logits_l)
    assert grads_p.keys() == grads_l.keys()
    for name in grads_p:
        scale = grads_p[name].abs().max().clamp_min(1e-3)
        assert (grads_p[name] - grads_l[name]).abs().max() / scale < 1e-6, name


def test_under_bf16_autocast_within_bf16_rounding():
    plain = tiny()
    model = copy.deepcopy(plain)
    lean.apply(model)
    batch = padded_batch()
    logits_p, grads_p = run(plain, batch, autocast=True)
    logits_l, grads_l = run(model, batch, autocast=True)
    assert torch.equal(logits_p, logits_l)
    for name in grads_p:
        scale = grads_p[name].abs().max().clamp_min(1e-3)
        assert (grads_p[name] - grads_l[name]).abs().max() / scale < 2e-2, name


def test_half_precision_weights_within_rounding():
    plain = tiny(dtype=torch.bfloat16)
    model = copy.deepcopy(plain)
    lean.apply(model)
    batch = padded_batch()
    logits_p, grads_p = run(plain, batch)
    logits_l, grads_l = run(model, batch)
    assert torch.equal(logits_p, logits_l)
    for name in grads_p:
        scale = grads_p[name].float().abs().max().clamp_min(1e-3)
        assert (grads_p[name].float() - grads_l[name].float()).abs().max() / scale < 3e-2, name


def test_through_lora_with_the_loop_loss():
    plain = peft.apply(tiny(), PeftCfg(method="lora", r=4, alpha=8, dropout=0.0,
                                       target_modules=["q_proj", "gate_proj", "down_proj"]))
    model = copy.deepcopy(plain)
    assert lean.apply(model) == 2 * LAYERS + 1 + LAYERS
    batch = padded_batch()
    n = torch.tensor(label_tokens(batch))
    grads = []
    for m in (plain, model):
        m.zero_grad(set_to_none=True)
        causal_lm_loss(m, batch, n).backward()
        grads.append({k: p.grad for k, p in m.named_parameters() if p.requires_grad})
    assert grads[0] and grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        assert torch.allclose(grads[0][k], grads[1][k], rtol=1e-5, atol=1e-7), k


def _saved_bytes(model, batch) -> int:
    """Bytes of the distinct storages autograd keeps for backward over one forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**{k: v for k, v in batch.items() if k != "labels"})
    return sum(seen.values())


def test_keeps_exactly_2h_plus_i_fewer_values_a_token_and_layer():
    plain = tiny()
    model = copy.deepcopy(plain)
    lean.apply(model)
    batch = padded_batch()
    tokens = batch["input_ids"].numel()
    saved = _saved_bytes(plain, batch) - _saved_bytes(model, batch)
    # fp32 values; the final norm keeps h fewer too (each norm's scale, one value a row, both keep)
    assert saved == tokens * 4 * (LAYERS * (2 * H + INTER) + H)


def test_without_gradients_the_modules_own_code_runs(monkeypatch):
    model = tiny()
    lean.apply(model)
    calls = []
    monkeypatch.setattr(lean._RMSNorm, "apply", lambda *a: calls.append(a))
    monkeypatch.setattr(lean._SiluMul, "apply", lambda *a: calls.append(a))
    with torch.no_grad():
        model(input_ids=padded_batch()["input_ids"])
    assert calls == []


def test_other_code_is_left_alone():
    from transformers import GemmaConfig, GemmaForCausalLM

    model = GemmaForCausalLM(GemmaConfig(vocab_size=97, hidden_size=H, intermediate_size=INTER, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         hidden_act="gelu_pytorch_tanh"))
    assert lean.apply(model) == 0  # Gemma's norm is (1 + weight) and its MLP GELU-gated


def test_the_lean_modules_survive_transformers_mode_switches():
    """A model loaded as tunelab loads it uses hub kernels (transformers' default where `kernels` is installed), and
    its every model.train() / eval() kernelizes it again, which gives each kernel layer (RMSNorm is one) its class's
    forward back: an instance-level lean forward went at the first switch, silently. The lean class stays."""
    from tunelab.core.config import ModelCfg
    from tunelab.models import loading

    model, _ = loading.load(ModelCfg(name="tiny-random-llama"))
    assert model.use_kernels  # (the kernelize walk runs at each switch: the check can fail)
    assert lean.apply(model) > 0
    model.train()
    model.eval()
    model.train()
    norms = [m for m in model.modules() if getattr(m, lean.MARK, False) and hasattr(m, "variance_epsilon")]
    assert norms and all(type(m).__name__.startswith("Lean") for m in norms)
    x = torch.randn(2, 3, norms[0].weight.shape[0], requires_grad=True)
    assert all(type(m(x).grad_fn).__name__ == "_RMSNormBackward" for m in norms)
