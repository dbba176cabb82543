"""train/loss.py: the output head only at labelled positions gives the plain `model(**batch).loss` and its
gradients (tiny Llama, fp32, padding and masked prompts), through PEFT adapters; the plain path is taken
where the shortcut cannot be exact (prefix tuning, soft-capped logits)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tunelab.core.config import CellConfig, PeftCfg
from tunelab.train import loss as loss_module
from tunelab.train import peft
from tunelab.train.chunked import auto_chunk, chunked_loss, set_chunk
from tunelab.train.data import IGNORE, block_causal_mask, label_tokens
from tunelab.train.loss import _causal_lm, causal_lm_loss, plain_loss, root_forward_loss


def tiny_llama(tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).train()


def padded_batch() -> dict[str, torch.Tensor]:
    """Three rows of different lengths, right-padded: a masked prompt, then a reply that carries labels."""
    g = torch.Generator().manual_seed(1)
    lengths, prompts = (11, 7, 14), (6, 3, 9)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE)
    mask = torch.zeros_like(ids)
    for i, (n, p) in enumerate(zip(lengths, prompts)):
        ids[i, :n] = torch.randint(1, 97, (n,), generator=g)
        labels[i, p:n] = ids[i, p:n]
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def packed_batch() -> dict[str, torch.Tensor]:
    """One row holding two examples (positions restart at 0), then two padding tokens, as data.collate_packed."""
    b = padded_batch()
    ids = torch.cat([b["input_ids"][0, :11], b["input_ids"][1, :7], torch.zeros(2, dtype=torch.long)])[None]
    labels = torch.cat([b["labels"][0, :11], b["labels"][1, :7], torch.full((2,), IGNORE)])[None]
    pos = torch.cat([torch.arange(11), torch.arange(7), torch.zeros(2, dtype=torch.long)])[None]
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "attention_mask": block_causal_mask(pos)}


def loss_and_grads(model, fn, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = fn(model, batch, torch.tensor(label_tokens(batch) + 3))  # + 3: a step's count spans other micro-batches
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same_as_plain(model, batch, fn=causal_lm_loss) -> None:
    fast_loss, fast = loss_and_grads(model, fn, batch)
    plain_loss_, plain = loss_and_grads(model, plain_loss, batch)
    torch.testing.assert_close(fast_loss, plain_loss_, rtol=1e-6, atol=1e-6)
    assert fast.keys() == plain.keys() and fast
    for name in plain:
        torch.testing.assert_close(fast[name], plain[name], rtol=1e-6, atol=1e-6, msg=name)


def head_rows(model, batch, fn=causal_lm_loss) -> int:
    """Rows the output head was applied to in one loss call."""
    seen = []
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape[:-1].numel()))
    try:
        fn(model, batch, 1)
    finally:
        handle.remove()
    return sum(seen)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("make_batch", [padded_batch, packed_batch])
def test_full_model_same_loss_and_gradients(tied, make_batch):
    model, batch = tiny_llama(tied), make_batch()
    assert_same_as_plain(model, batch)
    assert head_rows(model, batch) == label_tokens(batch) < batch["labels"].numel()


@pytest.mark.parametrize("method,targets", [
    ("lora", None),
    ("lora", ["q_proj", "v_proj", "lm_head"]),  # the head itself adapter-wrapped
    ("dora", None),
    ("ia3", None),
])
def test_peft_same_loss_and_gradients(method, targets):
    model = peft.apply(tiny_llama(), PeftCfg(method=method, dropout=0.0, target_modules=targets))
    if method != "ia3":  # peft starts B at zero: move it so the adapter changes the output
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(std=0.1)
    batch = padded_batch()
    assert _causal_lm(model) is not None
    assert_same_as_plain(model, batch)
    assert head_rows(model, batch) == label_tokens(batch)


def test_no_grad_validation_value():
    model, batch = tiny_llama(tied=True).eval(), padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(causal_lm_loss(model, batch, 5), plain_loss(model, batch, torch.tensor(5)))


def test_prefix_tuning_takes_the_plain_path():
    model = peft.apply(tiny_llama(), PeftCfg(method="prefix", num_virtual_tokens=4))
    assert _causal_lm(model) is None
    batch = padded_batch()
    fast_loss, fast = loss_and_grads(model, causal_lm_loss, batch)
    plain_loss_, plain = loss_and_grads(model, plain_loss, batch)
    assert torch.equal(fast_loss, plain_loss_)
    assert all(torch.equal(fast[n], plain[n]) for n in plain)
    assert head_rows(model, batch) == batch["labels"].numel()


def test_soft_capped_logits_take_the_plain_path():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, final_logit_softcapping=30.0)
    assert _causal_lm(Gemma2ForCausalLM(cfg)) is None
    cfg.final_logit_softcapping = None
    assert _causal_lm(Gemma2ForCausalLM(cfg)) is not None


def test_unknown_batch_fields_take_the_plain_path():
    model, batch = tiny_llama(), padded_batch()
    batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    assert head_rows(model, batch) == batch["labels"].numel()


@pytest.mark.parametrize("mask", [True, False], ids=["mask", "positions"])
@pytest.mark.parametrize("make_batch", [padded_batch, packed_batch])
def test_through_the_root_forward_same_loss_and_gradients(make_batch, mask, monkeypatch):
    """What FSDP2 and DeepSpeed run (their hooks sit on the root module): logits_to_keep as a boolean mask (the
    labelled positions) or, where transformers takes positions only, the positions any row has a label at."""
    monkeypatch.setattr(loss_module, "_MASK_TO_KEEP", mask)
    model, batch = tiny_llama(tied=True), make_batch()
    model.register_forward_pre_hook(lambda mod, args: None)  # a root hook, as FSDP2's: the body is not called alone
    assert _causal_lm(model) is None and _causal_lm(model, root_hooks_ok=True) is not None
    assert_same_as_plain(model, batch, root_forward_loss)
    labelled_columns = int((batch["labels"][:, 1:] != IGNORE).any(0).sum())
    expected = label_tokens(batch) if mask else labelled_columns * batch["labels"].shape[0]
    assert head_rows(model, batch, root_forward_loss) == expected < batch["labels"].numel()


@pytest.mark.parametrize("tied", [False, True])
def test_a_pipelines_last_stage_at_the_labelled_positions(tied):
    """What a pipeline's last stage and loss run (pipeline.py, stages.py): the stage takes the shifted labels
    and returns the summed loss at the labelled positions, its head and loss in chunks. Here one stage holds
    the whole model, so loss, gradients and head rows compare with the plain forward in one process."""
    from tunelab.train.loss import shifted_labels
    from tunelab.train.parallel import stages
    from tunelab.train.parallel.anatomy import anatomy

    model, batch = tiny_llama(tied=tied), padded_batch()
    set_chunk(model.get_output_embeddings(), 4)
    a = anatomy(model)
    stage = stages.Stage(model, a, list(range(len(a.layers))), first=True, last=True)

    def through_stage(m, b, n_items):
        return stage(b["input_ids"], b["attention_mask"], targets=shifted_labels(b["labels"])).sum() / n_items

    assert_same_as_plain(model, batch, through_stage)
    assert head_rows(model, batch, through_stage) == label_tokens(batch) < batch["labels"].numel()
    assert widest_logits(lambda: loss_and_grads(model, through_stage, batch), 97) == 4


def widest_logits(fn, vocab: int, hidden: int = 32) -> int:
    """The most rows of any tensor (rows, vocab) made while `fn` runs (forward and backward), leaving out the
    head weight's transposed view (hidden, vocab)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    widest = [0]

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] == vocab and t.shape[0] != hidden:
                    widest[0] = max(widest[0], t.shape[0])
            return out

    with Watch():
        fn()
    return widest[0]


@pytest.mark.parametrize("make_batch", [padded_batch, packed_batch])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, None])
def test_chunked_head_equals_the_plain_head_within_1e_6(tied, chunk, make_batch):
    """The head and loss in chunks of positions (train/chunked.py; None: the automatic chunk, one chunk here):
    loss and every gradient within 1e-6 of the plain `model(**batch).loss` in fp32, and no (positions,
    vocabulary) tensor wider than a chunk exists in forward or backward. Padded rows and packed ones."""
    model, batch = tiny_llama(tied), make_batch()
    set_chunk(model.get_output_embeddings(), chunk)
    fast_loss, fast = loss_and_grads(model, causal_lm_loss, batch)
    plain_loss_, plain = loss_and_grads(model, plain_loss, batch)
    torch.testing.assert_close(fast_loss, plain_loss_, rtol=1e-6, atol=1e-6)
    for name in plain:
        torch.testing.assert_close(fast[name], plain[name], rtol=1e-6, atol=1e-6, msg=name)
    n = label_tokens(batch)
    assert widest_logits(lambda: loss_and_grads(model, causal_lm_loss, batch), 97) == min(chunk or n, n)
    assert widest_logits(lambda: loss_and_grads(model, plain_loss, batch), 97) == batch["labels"].numel()


@pytest.mark.parametrize("make_batch", [padded_batch, packed_batch])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, None])
def test_early_gradients_equal_the_plain_head_within_1e_6(tied, chunk, make_batch):
    """The head's gradients built in its forward (`set_chunk(early=True)`, what every optimizer but LOMO/AdaLomo
    runs), with a tied weight through the one-buffer lookup the loop prepares (optimizers/tied.py), which adds
    its rows into the head's buffer: loss and every gradient within 1e-6 of a fresh model's plain loss in fp32;
    forward makes no logits wider than a chunk and backward none at all. Padded rows and packed ones."""
    from tunelab.optimizers.tied import prepare_for_fused
    from tunelab.train import chunked

    model, batch = tiny_llama(tied), make_batch()
    assert prepare_for_fused(model) == tied
    set_chunk(model.get_output_embeddings(), chunk, early=True)
    ready = []
    real = chunked.ReadyGrad.__init__
    chunked.ReadyGrad.__init__ = lambda self, grad: ready.append(1) or real(self, grad)
    try:
        fast_loss, fast = loss_and_grads(model, causal_lm_loss, batch)
    finally:
        chunked.ReadyGrad.__init__ = real
    assert len(ready) == int(tied)  # the tied lookup took the head's whole gradient
    plain_loss_, plain = loss_and_grads(tiny_llama(tied), plain_loss, batch)
    torch.testing.assert_close(fast_loss, plain_loss_, rtol=1e-6, atol=1e-6)
    for name in plain:
        torch.testing.assert_close(fast[name], plain[name], rtol=1e-6, atol=1e-6, msg=name)
    n = label_tokens(batch)
    assert widest_logits(lambda: loss_and_grads(model, causal_lm_loss, batch), 97) == min(chunk or n, n)
    loss = causal_lm_loss(model, batch, 1)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="earlier backward"):  # its buffers were scaled in place: once only
        loss.backward()


@pytest.mark.parametrize("tied", [False, True])
def test_early_head_reuses_its_buffers_only_when_nothing_holds_them(tied):
    """The early path's workspace (train/chunked.py `Workspace`): once zero_grad has dropped a step's gradient,
    the next step's head weight gradient is written into the same memory (no fresh allocation); a gradient
    still held (micro-batches accumulating, or kept by the caller) is never written over: the accumulated
    gradients equal the plain head's and the kept one is unchanged."""
    from tunelab.optimizers.tied import prepare_for_fused

    model, batch = tiny_llama(tied), padded_batch()
    prepare_for_fused(model)
    head = model.get_output_embeddings()
    set_chunk(head, 4, early=True)
    causal_lm_loss(model, batch, 1).backward()
    first = head.weight.grad.data_ptr()
    model.zero_grad(set_to_none=True)
    causal_lm_loss(model, batch, 1).backward()
    assert head.weight.grad.data_ptr() == first  # the dropped buffer, reused
    kept, before = head.weight.grad, head.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    causal_lm_loss(model, batch, 1).backward()
    assert torch.equal(kept, before) and head.weight.grad.data_ptr() != kept.data_ptr()
    del kept
    model.zero_grad(set_to_none=True)
    for _ in range(2):  # two micro-batches into one gradient
        causal_lm_loss(model, batch, 1).backward()
    fast = {n: p.grad.clone() for n, p in model.named_parameters()}
    plain = tiny_llama(tied)
    for _ in range(2):
        plain_loss(plain, batch, torch.tensor(1)).backward()
    for n, p in plain.named_parameters():
        torch.testing.assert_close(fast[n], p.grad, rtol=1e-6, atol=1e-6, msg=n)


@pytest.mark.parametrize("early", [False, True])
def test_chunked_loss_function_direct(early):
    """`chunked_loss` against `F.cross_entropy(hidden @ W.T)` on random rows, gradients of both inputs, with
    chunks that do not divide the rows, and the automatic chunk from the vocabulary."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(50, 16, generator=g).requires_grad_()
    t = torch.randint(0, 50, (37,), generator=g)
    want = torch.nn.functional.cross_entropy(h @ w.t(), t, reduction="sum")
    gh, gw = torch.autograd.grad(want * 0.3, (h, w))
    for chunk in (5, 37, 100):
        got = chunked_loss(h, w, t, chunk, early=early)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for a, b in zip(torch.autograd.grad(got * 0.3, (h, w)), (gh, gw)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert auto_chunk(32000) == 262 and auto_chunk(49152) == 170 and auto_chunk(10**9) == 16


@pytest.mark.parametrize("early", [False, True])
def test_bf16_autocast_matches_the_plain_head_within_bf16_rounding(early):
    """Under bf16 autocast (train.precision: bf16) the chunks compute as autocast would: bf16 matmuls, fp32
    loss; the weight's gradient summed in fp32 from bf16 products a block of vocabulary rows at a time (the plain
    head rounds the product of all positions to bf16 once)."""
    model, batch = tiny_llama(), padded_batch()
    set_chunk(model.get_output_embeddings(), 4, early=early)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast_loss, fast = loss_and_grads(model, causal_lm_loss, batch)
        plain_loss_, plain = loss_and_grads(model, plain_loss, batch)
    torch.testing.assert_close(fast_loss, plain_loss_, rtol=1e-2, atol=1e-2)
    for name in plain:
        torch.testing.assert_close(fast[name], plain[name], rtol=5e-2, atol=2e-3, msg=name)


def test_half_precision_weight_gradient_is_added_block_by_block():
    """The bf16 weight gradient's product runs a block of vocabulary rows at a time (more than one block here):
    every row gets its block's product, within bf16 rounding of the fp32 product, added to what was there."""
    from tunelab.train.chunked import PRODUCT_BLOCK_BYTES, _add_product

    torch.manual_seed(0)
    hidden = 4096
    vocab = 2 * PRODUCT_BLOCK_BYTES // (4 * hidden) + 37  # two whole blocks and a partial one
    g, h = torch.randn(5, vocab).bfloat16(), torch.randn(5, hidden).bfloat16()
    before = torch.randn(vocab, hidden)
    got = _add_product(before.clone(), g, h)
    want = before + g.float().t() @ h.float()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=2e-2)
    assert (got - before).abs().amin(1).gt(0).float().mean() > 0.99  # no block skipped


def test_no_kernel_on_cpu_and_the_chunk_is_read_from_the_head():
    """The Cut Cross-Entropy kernel is CUDA-only (and used only when installed); on CPU the torch chunks run
    with the chunk the stepper set on the head (`train.loss_chunk` through parallel.prepare)."""
    from tunelab.train import parallel as par
    from tunelab.train.chunked import CHUNK_ATTR

    model = tiny_llama()
    cell = CellConfig.model_validate({"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"},
                                      "train": {"loss_chunk": 3}})
    par.prepare(model, lambda ps: torch.optim.SGD(ps, lr=0.1), cell, par.setup(cell.parallel))
    assert getattr(model.get_output_embeddings(), CHUNK_ATTR) == 3
    assert widest_logits(lambda: loss_and_grads(model, causal_lm_loss, padded_batch()), 97) == 3
    assert "loss_chunk" not in CellConfig.model_validate({"model": {"name": "x"}, "data": {"recipe": "y"}}) \
        .identity()["train"]


def test_a_deferred_gradient_block_stays_small_at_few_labelled_positions():
    """A tied weight's gradient is built from the head's factors a block of vocabulary rows at a time: with
    few labelled positions the logits bound alone would allow the whole vocabulary in one block (a weight-sized
    gradient while a clipping pass holds every activation); the gradient's own bound keeps it to CHUNK_BYTES / 8."""
    from tunelab.train.chunked import CHUNK_BYTES, HeadFactors

    hidden, weight = torch.zeros(10, 64), torch.zeros(100_000, 64)
    few = HeadFactors(hidden, weight, torch.zeros(10, dtype=torch.long), torch.zeros(10), torch.ones(()), None)
    assert few.block_rows() * 64 * 4 <= CHUNK_BYTES // 8 and few.block_rows() < weight.shape[0]
    many = HeadFactors(torch.zeros(50_000, 64), weight, torch.zeros(50_000, dtype=torch.long), torch.zeros(50_000),
                       torch.ones(()), None)
    assert many.block_rows() * 50_000 * 8 <= CHUNK_BYTES  # the logits' bound where it is the tighter one


@pytest.mark.parametrize(("optimizer", "early"), [("adamw", True), ("lion", True), ("lomo", False)])
def test_the_stepper_builds_the_heads_gradients_early_unless_the_optimizer_updates_in_backward(optimizer, early):
    """parallel.prepare (every layout's entry) marks the head: gradients in forward for an optimizer that runs one
    backward per forward, the recomputing path for LOMO/AdaLomo (two backward passes over one graph)."""
    from tunelab.train import optim
    from tunelab.train.chunked import EARLY_ATTR
    from tunelab.train.parallel import Layout, prepare

    cell = CellConfig.model_validate({"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"},
                                      "optim": {"name": optimizer}, "train": {"steps": 1, "loss_chunk": 4}})
    model = tiny_llama(tied=True)
    prepare(model, lambda ps: optim.build(ps, cell.optim), cell, Layout(device=torch.device("cpu")))
    head = model.get_output_embeddings()
    assert getattr(head, EARLY_ATTR) is early and head.tunelab_loss_chunk == 4
