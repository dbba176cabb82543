"""The output head and its cross-entropy in chunks of positions: gradients built in forward, or recomputed.

At a realistic batch the head's logits (labelled positions x vocabulary, fp32) and their gradient are the
largest tensors of a step: 2,048 positions x 49,152 words is 403 MB each. Here the head and the loss run
as one autograd Function over (hidden states at the labelled positions, head weight, targets): forward
computes each chunk's logits, keeps only its log-sum-exp (one float per position) and drops them; backward
recomputes each chunk's logits, turns them into that chunk's gradient (softmax - one-hot) and adds its
products into the hidden states' and the weight's gradients. No full logits tensor and no full logits
gradient exists at any time; the loss and gradients are the plain head's up to float summation order
(tests/test_train_loss.py: within 1e-6 in fp32).

Most optimizers run one backward per forward and keep a whole gradient anyway: for them (`set_chunk(early=
True)`, which every stepper sets unless its optimizer updates inside backward) `_EarlyLoss` builds the
gradients in forward, where each chunk's logits are at hand, and backward only scales them by the loss's
gradient: the head's matmul runs 3 times a step instead of 4 (5 with a tied embedding, whose lookup
recomputed the logits once more), one softmax instead of two or three. Its price is the weight's fp32
gradient from the end of forward on, which a plain head allocates as backward starts, with every activation
alive too: the plain head's peak, one weight-sized gradient above the tied lookup's recomputing path (which
builds it after the activations are freed; measured: AdamW at 4 x 512 1.02-1.03x, benchmarks/README.md). LOMO
and AdaLomo keep the recomputing path: their two backward passes over one graph and their point, no whole
gradient, rule out a buffer built in forward.

The early path keeps its two large buffers from step to step (`Workspace`): a chunk's fp32 logits and the
weight's fp32 gradient, which the optimizer step reads and the next step's first chunk overwrites. Allocated
afresh they are 33 MB and 113 MB for SmolLM2 (170 positions x 49,152 words), above glibc's largest mmap
threshold, so each was mapped anew and faulted in page by page every step: those head products ran at 50-100
GFLOP/s in the loop against 130-200 into memory already touched (benchmarks/README.md). A buffer is reused only
when nothing else holds it (a gradient kept by an optimizer, or still the parameter's `.grad` while micro-batches
accumulate, gets a fresh one). The weight's gradient is alive at the peak anyway; the chunk's logits now are
too (33 MB for SmolLM2: AdamW's 4 x 512 peak 1.01x), which the memory model counted already.

The chunk (positions per chunk) is `train.loss_chunk`, or chosen from the vocabulary so that a chunk's fp32
logits and its one temporary stay within CHUNK_BYTES (`auto_chunk`). The stepper writes it on the head
module (`set_chunk`), where every layout's head call reads it.

The loss runs inside the head module's own call (`computing_loss`), so hooks on that module run around it
as around a plain head: FSDP2 unshards the weight there, DeepSpeed ZeRO-3 gathers it, and both do so again
before its backward. A root forward that calls the head itself (transformers' `logits_to_keep`) then
returns the summed loss as its `.logits`.

Tied embeddings in one process (optimizers/tied.py): the head's backward hands the weight's gradient to the
embedding lookup's backward, which runs last and adds its rows in: the early path hands its whole buffer
(`ReadyGrad`); under LOMO/AdaLomo it hands its factors (`HeadFactors`: hidden states, log-sum-exps, targets,
the loss's gradient), from which the lookup builds the one shared gradient a block of vocabulary rows at a
time, recomputing those rows' logits.

On CUDA, with half-precision compute and Apple's Cut Cross-Entropy installed (the `cce` extra), its kernel
computes the same loss (exact gradients: `filter_eps=None`), except under a tied lookup. Liger's fused linear
cross-entropy, which builds the gradients in forward as `_EarlyLoss` does, is not used: it scales its stored
gradients in place in backward, and under LOMO/AdaLomo (two backward passes over one graph) it would apply
that twice; elsewhere `_EarlyLoss` does the same work.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tunelab.train.parallel.memory import CHUNK_BYTES, auto_chunk

CHUNK_ATTR = "tunelab_loss_chunk"  # the head module's attribute holding train.loss_chunk
EARLY_ATTR = "tunelab_head_grads_early"  # whether the head's gradients are built in its forward (`_EarlyLoss`)
WORKSPACE_ATTR = "tunelab_head_workspace"  # the early path's buffers kept from step to step (`Workspace`)
__all__ = ["CHUNK_ATTR", "CHUNK_BYTES", "auto_chunk", "chunked_loss", "computing_loss", "head_loss", "set_chunk"]


def set_chunk(head: nn.Module, chunk: int | None, early: bool = False) -> None:
    """Record `train.loss_chunk` (None: automatic) on the output head module, where every head call reads it.
    `early`: build the head's gradients while its forward has each chunk's logits at hand (`_EarlyLoss`), for
    an optimizer that runs one backward per forward and keeps a whole gradient anyway (not LOMO/AdaLomo)."""
    setattr(head, CHUNK_ATTR, chunk)
    setattr(head, EARLY_ATTR, early)
    setattr(head, WORKSPACE_ATTR, Workspace() if early else None)


def _unshared(buf: torch.Tensor) -> bool:
    """Whether nothing but the holder's one reference holds `buf` or a view of its memory (torch's use counts:
    the storage's counts this call's Python storage object too). Where torch lacks them, never."""
    try:
        storage = torch._C._storage_Use_Count(buf.untyped_storage()._cdata)
        return storage == 2 and buf._use_count() == 1  # type: ignore[attr-defined]  # torch's stubs omit it
    except AttributeError:
        return False


class Workspace:
    """Buffers of the early head reused from step to step (see the module docstring): `get` hands back the first
    rows of the one kept under a name when it has at least as many, the same other sizes, dtype and device, and
    nothing else holds it; else a new one, kept from then on."""

    def __init__(self) -> None:
        self._kept: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._kept.get(name)
        if (buf is None or buf.shape[0] < shape[0] or buf.shape[1:] != shape[1:] or buf.dtype != dtype
                or buf.device != device or not _unshared(buf)):
            buf = self._kept[name] = torch.empty(shape, dtype=dtype, device=device)
        # A new tensor on the kept memory: autograd takes a gradient as `.grad` without a copy only when nothing
        # else holds that tensor; the kept one holds only the memory.
        return (buf if buf.shape[0] == shape[0] else buf[:shape[0]]).detach()


def _compute_dtype(device: torch.device) -> torch.dtype | None:
    """What autocast would run the head's matmul in (None: the tensors' own dtype)."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def _probs_minus_onehot(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor,
                        first: int = 0) -> torch.Tensor:
    """d(summed cross-entropy)/d(logits) in place of fp32 `logits` (rows x columns first..): softmax - one-hot."""
    g = logits.sub_(lse.unsqueeze(1)).exp_()
    hit = (targets >= first) & (targets < first + g.shape[1])
    rows = hit.nonzero().squeeze(1)
    g[rows, targets[rows] - first] -= 1.0
    return g


def _log_probs_inplace(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's cross-entropy against `targets`, and `logits` (fp32) turned into d(summed cross-entropy)/
    d(logits) in place: softmax - one-hot. One fused log-softmax written over the logits (torch's CPU kernel reads
    a row whole before writing it; tests/test_train_loss.py checks the result against the plain head), then exp:
    no chunk-sized temporary, where logsumexp's subtraction of the row maxima allocated one (33 MB at 170
    positions x 49,152 words, faulted in afresh every chunk: 80-130 ms of a CPU step, measured)."""
    torch.log_softmax(logits, dim=-1, out=logits)
    rows = logits.gather(1, targets[:, None]).squeeze(1).neg_()
    g = logits.exp_()
    g[torch.arange(g.shape[0], device=g.device), targets] -= 1.0
    return rows


def _logsumexp_inplace(logits: torch.Tensor) -> torch.Tensor:
    """Each row's log-sum-exp of fp32 `logits`, which it overwrites (torch.logsumexp allocates a chunk-sized
    temporary)."""
    top = logits.amax(dim=1)
    return logits.sub_(top[:, None]).exp_().sum(dim=1).log_().add_(top)


def _weight_grad_buffer(weight: torch.Tensor, positions: int, workspace: Workspace | None = None) -> torch.Tensor:
    """The head weight's fp32 gradient: uninitialized (or the workspace's, from an earlier step), as the first
    chunk writes it whole (`_add_chunk_grads`); zeros when there is no chunk."""
    if not positions:
        return torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    if workspace is not None:
        return workspace.get("weight_grad", tuple(weight.shape), torch.float32, weight.device)
    return torch.empty(weight.shape, dtype=torch.float32, device=weight.device)


def _logits(h: torch.Tensor, w: torch.Tensor, workspace: Workspace | None) -> torch.Tensor:
    """fp32 logits of the chunk `h` (compute dtype) against `w`, into the workspace's chunk buffer when there is
    one."""
    if workspace is None:
        return F.linear(h, w).float()
    out = workspace.get("logits", (h.shape[0], w.shape[0]), torch.float32, h.device)
    if h.dtype == torch.float32:
        return torch.mm(h, w.t(), out=out)
    return out.copy_(F.linear(h, w))


PRODUCT_BLOCK_BYTES = 8 * 2**20  # a block of the head weight's gradient, as fp32, in _add_product


def _add_product(out: torch.Tensor, g: torch.Tensor, h: torch.Tensor, first: bool = False) -> torch.Tensor:
    """`out` (fp32, vocabulary x hidden) += g.T @ h for half-precision `g` (rows x vocabulary) and `h`, a block
    of vocabulary rows at a time: each block's product runs in g's dtype (accumulated in fp32 inside the matmul
    and rounded once, as autocast's plain head rounds its one product) and is added in fp32 (`first`: written,
    `out` is uninitialized). Measured on a CPU with bf16 matrix units (170 positions x 49,152 x 576): 55 ms in
    blocks of about 3,600 rows, against 72 ms for the fp32 product of the upcast chunk and 125 ms for one whole
    bf16 product (its weight-sized temporary leaves the cache before it is added)."""
    rows = max(256, PRODUCT_BLOCK_BYTES // (4 * h.shape[1]))
    for a in range(0, out.shape[0], rows):
        block = torch.mm(g[:, a:a + rows].t(), h)
        (out[a:a + rows].copy_ if first else out[a:a + rows].add_)(block)
    return out


def _add_chunk_grads(gd: torch.Tensor, h: torch.Tensor, w: torch.Tensor, grad_h: torch.Tensor | None,
                     grad_w: torch.Tensor | None, a: int) -> None:
    """One chunk's share of the gradients, from its logits' gradient `gd` (compute dtype): its rows of the hidden
    states' gradient (from row `a`) and its product added into the weight's fp32 gradient. The first chunk
    (`a == 0`) writes the weight's gradient instead, so its buffer needs no zero fill (a weight-sized pass over
    fresh memory: 135 ms a step for SmolLM2's 113 MB on a CPU that faults its pages in at first touch)."""
    if grad_h is not None:
        rows = grad_h[a:a + gd.shape[0]]
        torch.mm(gd, w, out=rows) if rows.dtype == gd.dtype else rows.copy_(torch.mm(gd, w))
    if grad_w is not None:
        if gd.dtype == torch.float32:
            torch.mm(gd.t(), h, out=grad_w) if a == 0 else grad_w.addmm_(gd.t(), h)
        else:
            _add_product(grad_w, gd, h, first=a == 0)


class HeadFactors:
    """What the head weight's gradient is made of, kept instead of it (tied embeddings under LOMO/AdaLomo)."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                 scale: torch.Tensor, dtype: torch.dtype | None) -> None:
        self.hidden, self.weight, self.targets, self.lse, self.scale, self.dtype = \
            hidden, weight, targets, lse, scale, dtype

    def block(self, a: int, b: int) -> torch.Tensor:
        """Rows a..b of the weight's gradient, (b - a, hidden), in the compute dtype."""
        dt = self.dtype or self.hidden.dtype
        h, w = self.hidden.to(dt), self.weight[a:b].to(dt)
        g = _probs_minus_onehot(F.linear(h, w).float(), self.lse, self.targets, a).mul_(self.scale)
        return torch.mm(g.to(dt).t(), h)

    def block_rows(self) -> int:
        """Vocabulary rows per block: a block's logits and one temporary within CHUNK_BYTES, and its fp32
        gradient (rows x hidden) within CHUNK_BYTES / 8. Without the second bound a step with few labelled
        positions (the quickstart's ~170) made one block of the whole vocabulary: a weight-sized gradient and
        its logits, built in a clipping pass while every activation is alive (AdaLomo's quickstart peak)."""
        positions, hidden = self.hidden.shape
        return max(64, min(CHUNK_BYTES // (8 * max(1, positions)), CHUNK_BYTES // (8 * 4 * hidden)))


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                dtype: torch.dtype | None, link: object) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            dt = dtype or hidden.dtype
            w = weight.to(dt)
            lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
            rows = torch.empty_like(lse)
            for a in range(0, hidden.shape[0], chunk):
                logits = F.linear(hidden[a:a + chunk].to(dt), w).float()
                target = logits.gather(1, targets[a:a + chunk, None]).squeeze(1)
                lse[a:a + chunk] = _logsumexp_inplace(logits)
                rows[a:a + chunk] = lse[a:a + chunk] - target
                del logits
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.dtype, ctx.link = chunk, dtype, link
        return rows.sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        hidden, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if need_w and ctx.link is not None:  # the lookup's backward builds the shared weight's gradient
            ctx.link.pending.append((torch._C._current_graph_task_id(),
                                     HeadFactors(hidden, weight, targets, lse, grad, ctx.dtype)))
            need_w = False
        dt = ctx.dtype or hidden.dtype
        w = weight.to(dt)
        grad_h = torch.empty_like(hidden) if need_h else None
        # Summed in fp32 whatever the compute dtype (autocast's plain head rounds one product to bf16 instead).
        grad_w = _weight_grad_buffer(weight, hidden.shape[0]) if need_w else None
        for a in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[a:a + ctx.chunk].to(dt)
            logits = F.linear(h, w).float()
            g = _probs_minus_onehot(logits, lse[a:a + ctx.chunk], targets[a:a + ctx.chunk]).mul_(grad)
            gd = g.to(dt)
            _add_chunk_grads(gd, h, w, grad_h, grad_w, a)
            del logits, g, gd
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None


class ReadyGrad:
    """A head weight's gradient built whole in forward (`_EarlyLoss`), handed to a tied lookup's backward
    (optimizers/tied.py), which adds its looked-up rows into this very buffer."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.whole = grad  # the lookup adds into it when it is the pass's only head call

    def block(self, a: int, b: int) -> torch.Tensor:
        return self.whole[a:b]

    def block_rows(self) -> int:
        return self.whole.shape[0]


class _EarlyLoss(torch.autograd.Function):
    """The chunked head and loss with its gradients built in forward, where each chunk's logits are at hand:
    two head-sized matmuls and one softmax per chunk fewer than recomputing them in backward (and, for a tied
    embedding, a third recompute in the lookup's backward), the approach of Liger's fused linear
    cross-entropy. The price is the weight's fp32 gradient from the end of forward on, which a plain head
    allocates as backward starts, when every activation is alive too: the same peak. Backward scales the
    stored gradients by the loss's gradient in place, so it may run once; LOMO/AdaLomo's two passes over one
    graph and their no-whole-gradient point keep the recomputing `_ChunkedLoss`."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                dtype: torch.dtype | None, link: object, need_h: bool, need_w: bool,
                workspace: Workspace | None) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            dt = dtype or hidden.dtype
            w = weight.to(dt)
            rows = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
            grad_h = torch.empty_like(hidden) if need_h else None
            grad_w = _weight_grad_buffer(weight, hidden.shape[0], workspace) if need_w else None
            for a in range(0, hidden.shape[0], chunk):
                h, t = hidden[a:a + chunk].to(dt), targets[a:a + chunk]
                logits = _logits(h, w, workspace)
                rows[a:a + chunk] = _log_probs_inplace(logits, t)
                gd = logits.to(dt)
                del logits
                _add_chunk_grads(gd, h, w, grad_h, grad_w, a)
                del gd
        ctx.grads, ctx.link, ctx.weight_dtype = [grad_h, grad_w], link, weight.dtype
        return rows.sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        if ctx.grads is None:
            raise RuntimeError("the chunked head's early gradients were used by an earlier backward "
                               "(set_chunk(early=False) for an optimizer that runs backward twice)")
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        if grad_h is not None:
            grad_h.mul_(grad)
        if grad_w is not None:
            grad_w.mul_(grad)
            if ctx.link is not None:  # the tied lookup adds its rows into this buffer (optimizers/tied.py)
                ctx.link.pending.append((torch._C._current_graph_task_id(), ReadyGrad(grad_w)))
                grad_w = None
            else:
                grad_w = grad_w.to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None


@functools.cache
def _cce() -> Callable | None:
    try:
        from cut_cross_entropy import linear_cross_entropy
    except ImportError:
        return None
    return linear_cross_entropy


def chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int | None = None,
                 link: object = None, early: bool = False, workspace: Workspace | None = None) -> torch.Tensor:
    """Summed fp32 cross-entropy of `hidden @ weight.T` (rows x vocabulary, never whole) against `targets`.
    `link`: the tied lookup's (optimizers/tied.py) that the weight's gradient is deferred to. `early`: the
    gradients are built in forward (`_EarlyLoss`); backward may then run once. `workspace`: the early path's
    buffers, kept from step to step."""
    dtype = _compute_dtype(hidden.device)
    half = (dtype or weight.dtype) in (torch.bfloat16, torch.float16)
    cce = _cce() if hidden.is_cuda and half and link is None else None
    if cce is not None:
        dt = dtype or weight.dtype
        return cce(hidden.to(dt), weight.to(dt), targets, reduction="sum", filter_eps=None, impl="cce").float()
    chunk = chunk or auto_chunk(weight.shape[0])
    need_h, need_w = hidden.requires_grad, weight.requires_grad
    if early and torch.is_grad_enabled() and (need_h or need_w):
        return _EarlyLoss.apply(hidden, weight, targets, chunk, dtype, link, need_h, need_w, workspace)
    return _ChunkedLoss.apply(hidden, weight, targets, chunk, dtype, link)


def _linear_weight(head: nn.Module) -> torch.Tensor | None:
    """The weight of a bias-free linear head (FSDP2's subclass included), else None (an adapter-wrapped head)."""
    if isinstance(head, nn.Linear) and head.bias is None:
        return head.weight
    return None


def _checkpointed(forward: Callable, hidden: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Any head module (LoRA on the head): each chunk's logits recomputed in backward by checkpointing."""
    from torch.utils.checkpoint import checkpoint

    def part(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(forward(h).float(), t, reduction="sum")

    parts = [checkpoint(part, hidden[a:a + chunk], targets[a:a + chunk], use_reentrant=False)
             for a in range(0, hidden.shape[0], chunk)]
    return torch.stack(parts).sum()


def _head_loss(head: nn.Module, forward: Callable, hidden: torch.Tensor, targets: torch.Tensor,
               rows: torch.Tensor | None) -> torch.Tensor:
    h = hidden.reshape(-1, hidden.shape[-1])
    if rows is not None:
        h = h[rows]
    weight = _linear_weight(head)
    chunk = getattr(head, CHUNK_ATTR, None)
    if weight is None:
        return _checkpointed(forward, h, targets, chunk or auto_chunk(getattr(head, "out_features", 65536)))
    tied_link = getattr(head, "tied_link", None)  # set by optimizers/tied.py prepare_for_fused
    link = tied_link(hidden) if callable(tied_link) else None
    return chunked_loss(h, weight, targets, chunk, link, getattr(head, EARLY_ATTR, False),
                        getattr(head, WORKSPACE_ATTR, None))


@contextlib.contextmanager
def computing_loss(head: nn.Module, targets: torch.Tensor, rows: torch.Tensor | None = None) -> Iterator[None]:
    """While active, `head(hidden)` returns the summed cross-entropy of its logits against `targets` instead
    of the logits, computed in chunks inside the head module's call (its hooks run around it). `rows`: a
    boolean mask of the flattened rows `hidden` brings to keep (the others carry no label)."""
    own = head.__dict__.get("forward")  # an instance-level forward (optimizers/tied.py), for other heads
    plain = own or type(head).forward.__get__(head)
    ran = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        ran.append(True)
        return _head_loss(head, plain, hidden, targets, rows)

    head.forward = forward
    try:
        yield
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own
    if not ran:
        raise RuntimeError("the model's forward did not call its output head")


def head_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed fp32 cross-entropy of `head(hidden)` (rows x hidden) against `targets`, in chunks, through the
    head module's call."""
    with computing_loss(head, targets):
        return head(hidden)
