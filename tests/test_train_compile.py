"""train.compile: the decoder body of a one-process step under torch.compile trains as the eager step does, on
padded and on packed rows (packed rows attended example by example through tunelab's operator, opaque to the
compiler: train/segments.py), in one graph with no break, validation too; the model is handed back uncompiled."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from test_data_pack import data, tiny_llama  # noqa: F401 - the module-scoped packed dataset fixture

from tunelab.core.config import CellConfig
from tunelab.train import segments
from tunelab.train.loop import run


def _records(recipe, tok, ds, pack: bool, compiled: bool, folder) -> list[dict]:
    cfg = CellConfig.model_validate({
        "model": {"name": "tiny-random-llama"}, "data": {"recipe": str(recipe), "pack": pack},
        "train": {"steps": 3, "batch_size": 2, "save_final": False, "eval_every": 3, "compile": compiled},
        "eval": {"tasks": [], "val_batches": 1}, "tracking": {"wandb": False}})
    model = tiny_llama(len(tok))
    run(model, tok, ds, cfg, folder)
    assert model.model._compiled_call_impl is None  # handed back with its own eager forward
    return [json.loads(line) for line in next(folder.rglob("metrics.jsonl")).read_text().splitlines()]


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_compiled_steps_train_as_eager_steps(data, tmp_path, pack):  # noqa: F811
    from torch._dynamo.utils import counters

    recipe, tok, built = data
    eager = _records(recipe, tok, built[pack], pack, False, tmp_path / "eager")
    torch._dynamo.reset()  # compiled afresh: what another test compiled is not counted, nor reused
    counters.clear()
    compiled = _records(recipe, tok, built[pack], pack, True, tmp_path / "compiled")
    assert counters["stats"]["unique_graphs"] >= 2  # the training body and, without gradients, validation's
    assert not counters["graph_break"]  # the body is one graph: packed rows' attention did not break it
    for key in ("loss", "val_loss"):
        want = [r[key] for r in eager if key in r]
        got = [r[key] for r in compiled if key in r]
        assert len(got) == len(want) and want
        assert got == pytest.approx(want, rel=1e-5)


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
