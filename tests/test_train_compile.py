"""train.compile: the decoder body of a one-process step under torch.compile trains as the eager step does, on
padded and on packed rows (packed rows attended example by example through tunelab's operator, opaque to the
compiler: train/segments.py), in one graph with no break, validation too, with the loss and every gradient of the
plain transformers model; the model is handed back uncompiled."""

from __future__ import annotations

import contextlib
import json
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from test_data_pack import data, tiny_llama  # noqa: F401 - the module-scoped packed dataset fixture

from tunelab.core.config import CellConfig
from tunelab.train import segments
from tunelab.train.data import block_causal_mask, label_tokens
from tunelab.train.loop import run


def _records(recipe, tok, ds, pack: bool, compiled: bool, folder, first: dict | None = None) -> list[dict]:
    """The loop's metrics records; `first`: filled with the first step's batch, label count and the gradients that
    step hands to clipping (every trainable parameter's, by name)."""
    cfg = CellConfig.model_validate({
        "model": {"name": "tiny-random-llama"}, "data": {"recipe": str(recipe), "pack": pack},
        "train": {"steps": 3, "batch_size": 2, "save_final": False, "eval_every": 3, "compile": compiled},
        "eval": {"tasks": [], "val_batches": 1}, "tracking": {"wandb": False}})
    model = tiny_llama(len(tok))
    with contextlib.ExitStack() as patches:
        if first is not None:
            patches.enter_context(_first_step(model, first))
        run(model, tok, ds, cfg, folder)
    assert model.model._compiled_call_impl is None  # handed back with its own eager forward
    return [json.loads(line) for line in next(folder.rglob("metrics.jsonl")).read_text().splitlines()]


@contextlib.contextmanager
def _first_step(model, first: dict):
    """Record the first train_step's micro-batch and label count, and the gradients it clips."""
    from tunelab.train.parallel.local import LocalStepper

    step, clip = LocalStepper.train_step, torch.nn.utils.clip_grad_norm_
    names = {p: n for n, p in model.named_parameters()}

    def train_step(self, micro, n_items, *a, **kw):
        if "batch" not in first:
            first.update(batch={k: v.clone() for k, v in micro[0].items()}, n_items=n_items)
        return step(self, micro, n_items, *a, **kw)

    def clipping(params, *a, **kw):
        params = list(params)
        if "grads" not in first:
            first["grads"] = {names[p]: p.grad.detach().clone() for p in params}
        return clip(params, *a, **kw)

    with mock.patch.object(LocalStepper, "train_step", train_step), \
            mock.patch.object(torch.nn.utils, "clip_grad_norm_", clipping):
        yield


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_compiled_steps_train_as_eager_steps(data, tmp_path, pack):  # noqa: F811
    """And the compiled step's loss and every gradient equal those of the plain transformers model (a fresh one,
    eager, its own `model(**batch).loss`, packed rows under a block-diagonal mask) through plain autograd."""
    from torch._dynamo.utils import counters

    recipe, tok, built = data
    eager = _records(recipe, tok, built[pack], pack, False, tmp_path / "eager")
    torch._dynamo.reset()  # compiled afresh: what another test compiled is not counted, nor reused
    counters.clear()
    first: dict = {}
    compiled = _records(recipe, tok, built[pack], pack, True, tmp_path / "compiled", first)
    assert counters["stats"]["unique_graphs"] >= 2  # the training body and, without gradients, validation's
    assert not counters["graph_break"]  # the body is one graph: packed rows' attention did not break it
    for key in ("loss", "val_loss"):
        want = [r[key] for r in eager if key in r]
        got = [r[key] for r in compiled if key in r]
        assert len(got) == len(want) and want
        assert got == pytest.approx(want, rel=1e-5)
    batch = dict(first["batch"])
    if pack:  # one flattened row (examples attended apart): the plain model gets its block-diagonal mask
        assert "attention_mask" not in batch and first["n_items"] == label_tokens(batch)
        batch["attention_mask"] = block_causal_mask(batch["position_ids"])
    plain = tiny_llama(len(tok)).train()
    loss = plain(**batch).loss  # transformers' mean over the labelled positions
    loss.backward()
    assert compiled[0]["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    grads = {n: p.grad for n, p in plain.named_parameters()}
    assert first["grads"].keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(first["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def _examples_apart(q, k, v, lengths, scale, fp32_below):
    outs, a = [], 0
    for n in lengths:
        s = slice(a, a + n)
        qs, ks, vs = (t[:, :, s].float() if n < fp32_below else t[:, :, s] for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                   enable_gqa=True).to(q.dtype))
        a += n
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("dtype,fp32_below", [(torch.float32, 0), (torch.bfloat16, 0), (torch.bfloat16, 6)])
def test_the_by_example_operator_is_sdpa_over_each_example(dtype, fp32_below):
    """Forward and gradients equal autograd through SDPA run on each example (a short one in fp32 when asked);
    torch's opcheck tests its registration (fake shapes and strides, autograd, compile)."""
    torch.manual_seed(0)
    lengths = (7, 5, 1)
    q = torch.randn(1, 4, 13, 8, dtype=dtype).transpose(1, 2).contiguous().transpose(1, 2)  # as attention gets it
    k, v = (torch.randn(1, 2, 13, 8, dtype=dtype) for _ in range(2))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    args = (q, k, v, pos, 0.35, fp32_below)
    torch.library.opcheck(segments.by_example_sdpa, args)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = segments.by_example_sdpa(*leaves, pos, 0.35, fp32_below)
    ref = _examples_apart(*refs, lengths, 0.35, fp32_below)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    assert out.dtype == dtype and torch.equal(out, ref)
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32 and not lse.requires_grad
    for got, want in zip(leaves, refs):
        torch.testing.assert_close(got.grad, want.grad, atol=0, rtol=0)
