"""Tied input/output embeddings in one process: one gradient buffer for the shared weight, not three.

With a tied weight W (vocab x hidden), autograd computes the output head's dense gradient G^T H first
and holds it through the whole backward until the input embedding's gradient arrives last; it then
sums the two into a new tensor (measured on CPU, torch 2.13: about three W-sized buffers at once with
the embedding's dense gradient, two with a sparse one, which autograd never adds in place into a dense
tensor). For the update-in-backward optimizers that was most of what a step adds to memory; for the others
(the loop prepares every one-process model) it is two weight-sized allocations per step saved.

`prepare_for_fused(model)` routes both contributions through two small autograd functions. The head's
backward keeps only its factors (the logits' gradient and the hidden states, a few MB) and returns no
weight gradient; the embedding's backward, which runs last, builds G^T H in one buffer, adds the looked-up
rows' gradients into it in place and hands that single tensor to autograd as W's gradient. W's hook then
sees one dense gradient equal to autograd's sum (up to float rounding order), built only after the
activations a plain backward frees have been freed. In the norm pass of a clipped step (its graph
retained, so every activation still alive) the lookup only measures that gradient, a block of rows at a
time, and reports the squared norm to the optimizer. Forward values are unchanged.

Only for a single process: FSDP/TP shard or wrap the modules themselves.
"""

from __future__ import annotations

import ctypes
import functools
import types

import torch
import torch.nn.functional as F
from torch import nn

CHUNK_ROWS = 4096  # rows of the shared weight's gradient built at a time when only its norm is needed


class _Link:
    """Ties one forward's embedding lookup to the head calls of the same forward."""

    def __init__(self, optimizer=None):
        self.optimizer = optimizer  # the fused optimizer: in its norm pass the gradient is only measured
        # (backward pass id, logits' grad, head input) per head call, both as (tokens, features). The id
        # keeps a pass that ran the head but not the lookup (autograd.grad on some inner tensor) from
        # leaking into the next pass.
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []


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
        if opt is not None and opt.measuring:
            # The clipping pass needs only the norm, while its retained graph holds every activation: build
            # the gradient a block of rows at a time, never whole (the update pass builds it whole).
            parts = [(g, h) for t, g, h in pending if t == task]
            pending.clear()
            opt.add_sq_norm(_sq_norm(parts, idx, rows, ctx.shape))
            return None, None, None, None
        if rows.device.type == "cpu" and opt is not None:  # memory is LOMO's point; the others keep the pages
            _release_freed_pages()
        grad = None
        while pending:  # popped one by one: each logits' gradient is freed as soon as it is used
            t, g, h = pending.pop()
            if t != task:
                continue
            part = torch.mm(g.t(), h.to(g.dtype))
            del g, h
            grad = part if grad is None else grad.add_(part)
            del part
        if grad is None:
            grad = rows.new_zeros(ctx.shape)
        elif grad.dtype != rows.dtype:
            grad = grad.to(rows.dtype)
        grad.index_add_(0, idx, rows.to(grad.dtype))
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


def _sq_norm(parts: list, idx: torch.Tensor, rows: torch.Tensor, shape) -> torch.Tensor:
    """Squared norm of sum(g^T h) + the looked-up rows, in the dtypes the whole gradient would have."""
    total = torch.zeros((), dtype=torch.float32, device=rows.device)
    for a in range(0, shape[0], CHUNK_ROWS):
        b = min(a + CHUNK_ROWS, shape[0])
        block = None
        for g, h in parts:
            piece = torch.mm(g[:, a:b].t(), h.to(g.dtype))
            block = piece if block is None else block.add_(piece)
        block = rows.new_zeros((b - a, shape[1])) if block is None else block.to(rows.dtype)
        sel = (idx >= a) & (idx < b)
        block.index_add_(0, idx[sel] - a, rows[sel].to(block.dtype))
        total += torch.linalg.vector_norm(block.float()).square()
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
        ctx.link.pending.append((torch._C._current_graph_task_id(), g, h))
        return grad_hidden, None, None, None


def prepare_for_fused(model: nn.Module, optimizer=None) -> bool:
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

    def head(self, hidden):
        if not torch.is_grad_enabled() or not self.weight.requires_grad:
            return F.linear(hidden, self.weight)
        dev = hidden.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        # Deferred to the lookup only when its backward is sure to run after this head's: its output must
        # be upstream of the head's input (not so for inputs_embeds, or a detached lookup).
        link = current["link"]
        if link is not None and not _reaches(hidden.grad_fn, current["node"]):
            link = None
        return _Head.apply(hidden, self.weight, link, dtype)

    inp.forward = types.MethodType(lookup, inp)
    out.forward = types.MethodType(head, out)
    return True
