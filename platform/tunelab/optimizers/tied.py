"""Tied input/output embeddings in one process: one gradient buffer for the shared weight, not three.

With a tied weight W (vocab x hidden), autograd computes the output head's dense gradient G^T H first
and holds it through the whole backward until the input embedding's gradient arrives last; it then
sums the two into a new tensor (measured on CPU, torch 2.13: about three W-sized buffers at once with
the embedding's dense gradient, two with a sparse one, which autograd never adds in place into a dense
tensor). For the update-in-backward optimizers that was most of what a step adds to memory; for the others
(the loop prepares every one-process model) it is two weight-sized allocations per step saved.

`prepare_for_fused(model)` routes both contributions to the embedding lookup's backward, which runs last:
the head's backward returns no weight gradient but keeps only its factors, and the lookup builds W's whole
gradient from them a block of vocabulary rows at a time, adds the looked-up rows' gradients into it in
place and hands that single tensor to autograd as W's gradient. W's hook then sees one dense gradient equal
to autograd's sum (up to float rounding order), built only after the activations a plain backward frees
have been freed. The factors: for the chunked head and loss (train/chunked.py, what training runs) the
hidden states, log-sum-exps and targets, from which a block's logits are recomputed (`HeadFactors`); for a
plain head call (the loss's fallback path) the logits' gradient and the hidden states. In the norm pass of
a clipped step (its graph retained, so every activation still alive) the lookup only measures that
gradient, block by block, and reports the squared norm to the optimizer. Forward values are unchanged.

Only for a single process: FSDP/TP shard or wrap the modules themselves.
"""

from __future__ import annotations

import ctypes
import functools
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

CHUNK_ROWS = 4096  # rows of the shared weight's gradient built at a time from a plain head's factors


class _Link:
    """Ties one forward's embedding lookup to the head calls of the same forward."""

    def __init__(self, optimizer=None):
        self.optimizer = optimizer  # the fused optimizer: in its norm pass the gradient is only measured
        # (backward pass id, factors with .block(a, b) and .block_rows()) per head call. The id keeps a pass
        # that ran the head but not the lookup (autograd.grad on some inner tensor) from leaking into the next.
        self.pending: list[tuple[int, object]] = []


class _Product:
    """A plain head call's factors: the logits' gradient g and the head's input h, as (tokens, features)."""

    def __init__(self, g: torch.Tensor, h: torch.Tensor):
        self.g, self.h = g, h

    def block(self, a: int, b: int) -> torch.Tensor:
        return torch.mm(self.g[:, a:b].t(), self.h.to(self.g.dtype))

    def block_rows(self) -> int:
        return CHUNK_ROWS


def _reaches(node, target) -> bool:
    """Whether backward from `node` runs `target` (so the lookup's backward will collect the head's part)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is target:
            return True
        if n is None or n in seen:
            continue
        seen.add(n)
        todo.extend(f for f, _ in n.next_functions)
    return False


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, link, padding_idx):
        ctx.save_for_backward(ids)
        ctx.link, ctx.padding_idx, ctx.shape = link, padding_idx, weight.shape
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        task, pending = torch._C._current_graph_task_id(), ctx.link.pending
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        idx = ids.reshape(-1)
        if ctx.padding_idx is not None:  # as F.embedding: the padding row gets no gradient
            keep = idx != ctx.padding_idx
            idx, rows = idx[keep], rows[keep]
        opt = ctx.link.optimizer
        parts = [f for t, f in pending if t == task]
        pending.clear()
        if opt is not None and opt.measuring:
            # The clipping pass needs only the norm, while its retained graph holds every activation: build
            # the gradient a block of rows at a time, never whole (the update pass builds it whole).
            opt.add_sq_norm(_blocks(parts, idx, rows, ctx.shape, None))
            return None, None, None, None
        if rows.device.type == "cpu" and opt is not None:  # memory is LOMO's point; the others keep the pages
            _release_freed_pages()
        whole = getattr(parts[0], "whole", None) if len(parts) == 1 else None
        if whole is not None and whole.dtype == rows.dtype:
            # The head built its whole gradient in forward (train/chunked.py `ReadyGrad`): add into it.
            return None, whole.index_add_(0, idx, rows), None, None
        grad = rows.new_empty(ctx.shape)
        _blocks(parts, idx, rows, ctx.shape, grad)
        return None, grad, None, None


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def _release_freed_pages() -> None:
    """glibc keeps the pages of freed activations resident; hand them back before the weight-sized
    gradient is built, or the process holds both (malloc_trim returns whole free pages of every arena)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _blocks(parts: list, idx: torch.Tensor, rows: torch.Tensor, shape, out: torch.Tensor | None) -> torch.Tensor:
    """sum(head factors) + the looked-up rows, a block of vocabulary rows at a time: written into `out`, or
    (out None) only measured. Returns the squared norm (0 when written), in the dtypes the whole gradient has."""
    total = torch.zeros((), dtype=torch.float32, device=rows.device)
    step = min([f.block_rows() for f in parts] or [CHUNK_ROWS])
    for a in range(0, shape[0], step):
        b = min(a + step, shape[0])
        block = None
        for f in parts:
            piece = f.block(a, b)
            block = piece if block is None else block.add_(piece)
            del piece
        block = rows.new_zeros((b - a, shape[1])) if block is None else block.to(rows.dtype)
        sel = (idx >= a) & (idx < b)
        block.index_add_(0, idx[sel] - a, rows[sel].to(block.dtype))
        if out is None:
            total += torch.linalg.vector_norm(block.float()).square()
        else:
            out[a:b] = block
        del block
    return total


class _Head(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, link, dtype):
        ctx.save_for_backward(hidden, weight)
        ctx.link, ctx.dtype = link, dtype
        if dtype is not None:  # what autocast would do for F.linear: compute in its dtype
            return F.linear(hidden.to(dtype), weight.to(dtype))
        return F.linear(hidden, weight)

    @staticmethod
    def backward(ctx, grad_logits):
        hidden, weight = ctx.saved_tensors
        w = weight if ctx.dtype is None else weight.to(ctx.dtype)
        grad_hidden = torch.matmul(grad_logits, w) if ctx.needs_input_grad[0] else None
        del w
        if not ctx.needs_input_grad[1]:
            return grad_hidden, None, None, None
        h = (hidden if ctx.dtype is None else hidden.to(ctx.dtype)).reshape(-1, hidden.shape[-1])
        g = grad_logits.reshape(-1, grad_logits.shape[-1])
        if ctx.link is None:  # no lookup in this forward (inputs_embeds): the head's own gradient
            return grad_hidden, torch.mm(g.t(), h).to(weight.dtype), None, None
        # The lookup's backward, which runs last in this pass, builds W's whole gradient.
        ctx.link.pending.append((torch._C._current_graph_task_id(), _Product(g, h)))
        return grad_hidden, None, None, None


def prepare_for_fused(model: Any, optimizer=None) -> bool:
    """Make a tied embedding/head pair share one gradient buffer; False (and no change) when not tied.

    Call once, in a single-process run. With the LOMO/AdaLomo `optimizer` its clipping pass measures the
    shared weight's gradient block by block instead of building it."""
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if not (type(inp) is nn.Embedding and type(out) is nn.Linear and out.bias is None and inp.weight is out.weight):
        return False
    if inp.max_norm is not None or inp.scale_grad_by_freq or inp.sparse:
        return False
    # The latest lookup's link and backward node (kept here, not on the link: the node holds the link).
    current: dict = {"link": None, "node": None}

    def lookup(self, ids):
        if not torch.is_grad_enabled() or not self.weight.requires_grad:
            return F.embedding(ids, self.weight, self.padding_idx)
        current["link"] = link = _Link(optimizer)
        out = _Lookup.apply(ids, self.weight, link, self.padding_idx)
        current["node"] = out.grad_fn
        return out

    def link_for(hidden):
        """The latest lookup's link when its backward is sure to run after this head's: its output must be
        upstream of the head's input (not so for inputs_embeds, or a detached lookup)."""
        link = current["link"]
        if link is not None and not _reaches(hidden.grad_fn, current["node"]):
            link = None
        return link

    def head(self, hidden):
        if not torch.is_grad_enabled() or not self.weight.requires_grad:
            return F.linear(hidden, self.weight)
        dev = hidden.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        return _Head.apply(hidden, self.weight, link_for(hidden), dtype)

    inp.forward = types.MethodType(lookup, inp)
    out.forward = types.MethodType(head, out)
    # The chunked head and loss (train/chunked.py) ask for the link themselves.
    out.tied_link = lambda hidden: link_for(hidden) if torch.is_grad_enabled() and out.weight.requires_grad else None
    return True
