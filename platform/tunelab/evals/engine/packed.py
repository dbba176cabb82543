"""Packed forward passes of a transformers causal LM: the model plumbing under tunelab's evaluation
engine (`evals/engine/generate.py` schedules them; `evals/lmeval/lm.py` scores log-likelihoods with them).

A pass is one sequence (batch 1) holding several requests' tokens one after the other, as `Segment`s.
Each segment attends to the keys and values before it (a shared prefix run once, or its own slot in a
buffer that keeps them between passes) and causally to itself: no padding between requests, and the
output head runs only at the positions whose logits are wanted.

The model's own modules do the work: `PackedModel` registers an attention function with transformers
(`AttentionInterface`) and selects it only while it runs the model (`running`); the function reads and
writes the slot buffers. A model whose attention does not go through that interface is detected by a
self-check on first use (`supported`), and callers fall back to HFLM or `model.generate`.

A request's numbers do not depend on what else is in the pass, by construction where possible and by
measurement where not (tests/test_eval_generate.py checks batch sizes 1, 4 and 16):

- attention is computed segment by segment over exactly that segment's keys (padded key positions,
  masked to zero weight, would still change how softmax and the weighted sum are blocked and rounded);
- the matrix products see every row of the pass, and on CPU MKL's sgemm rounds a row differently when
  a thread gets fewer than 4 rows (measured: 1, 2 and 3 rows differ from 4 or more, at any position in
  the matrix). So every pass, and the rows the output head runs on, are padded to a multiple of
  `ROW_QUANTUM` rows whose results are dropped.

On a GPU a decoding step (one token per slot) attends in one masked call for all rows instead:
launching kernels row by row would cost more than the arithmetic, and GPU kernels round by shape
anyway, so there results agree across batch sizes up to near-ties only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tunelab.evals.engine import route

ROW_QUANTUM = 4  # every pass runs a multiple of this many token rows; see the module docstring
ATTN_NAME = "tunelab_packed"
STATE_KWARG = "tunelab_packed"


@dataclass(frozen=True)
class Segment:
    """A run of consecutive tokens of one sequence inside a packed forward pass.

    `start` is the position of its first token. With a `slot`, its keys and values are written into that
    slot at [start, start + length) and it attends to the slot's first start + length positions (the slot
    already holds the earlier ones). Without one, it attends to `prefix` (the keys and values of the
    positions before `start`, or None when start is 0) and to itself, and nothing is kept.

    `adapter`: the PEFT adapter its tokens go through when the model hosts several (route.py; its prefix's or
    slot's keys and values must come from the same adapter); None: the model as it is."""

    start: int
    length: int
    slot: int | None = None
    prefix: Prefix | None = None
    adapter: str | None = None


class Prefix:
    """Keys and values of a shared prefix (`run_prefix`'s layer -> (k, v), its first `length` positions) in
    buffers with `room` positions after them. A segment that attends to the prefix writes its own keys and
    values there and attends to the buffer's first length + its own positions, so the prefix is never copied
    per segment (segments run one after another, so one buffer serves them all). `room` must not depend on
    the batch (the longest sequence of the prefix's group, say): it sets the buffers' strides."""

    def __init__(self, kv: dict, length: int, room: int) -> None:
        self.length, self.kv = length, {}
        for layer, (k, v) in kv.items():
            kb, vb = (t.new_empty((1, t.shape[1], length + room, t.shape[3])) for t in (k, v))
            kb[:, :, :length], vb[:, :, :length] = k[:, :, :length], v[:, :, :length]
            self.kv[layer] = (kb, vb)

    def with_own(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kb, vb = self.kv[layer]
        end = self.length + k_new.shape[2]
        if end > kb.shape[2]:
            raise ValueError(f"a segment of {k_new.shape[2]} tokens after a prefix with room for "
                             f"{kb.shape[2] - self.length}")
        kb[:, :, self.length:end], vb[:, :, self.length:end] = k_new, v_new
        return kb[:, :, :end], vb[:, :, :end]


class Slots:
    """Keys and values of every layer for `n` slots, each `cap` positions long, allocated on first use
    (their shapes come from the model's own key states) and grown when a row outgrows them."""

    def __init__(self, n: int, cap: int):
        self.n, self.cap = n, cap
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def layer(self, idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if idx not in self.k:
            shape = (self.n, like.shape[1], self.cap, like.shape[3])
            # zeros, not empty: positions beyond a row's length are never read, but stay finite anyway
            self.k[idx] = like.new_zeros(shape)
            self.v[idx] = like.new_zeros(shape)
        return self.k[idx], self.v[idx]

    def ensure(self, needed: int) -> None:
        if needed <= self.cap:
            return
        cap = max(needed, 2 * self.cap)
        for store in (self.k, self.v):
            for idx, old in store.items():
                new = old.new_zeros((*old.shape[:2], cap, old.shape[3]))
                new[:, :, : self.cap] = old
                store[idx] = new
        self.cap = cap

    def put_prefix(self, slot: int, prefix: dict, p: int) -> None:
        for layer, (k, v) in prefix.items():
            ks, vs = self.layer(layer, k)
            ks[slot, :, :p] = k[0, :, :p]
            vs[slot, :, :p] = v[0, :, :p]


class _Pass:
    """The segments of one packed forward pass (batch 1, the segments' tokens one after the other, then
    padding); passed to the attention function as a keyword argument. `collect`, when given, receives
    every layer's keys and values of the whole pass (a prefix run)."""

    def __init__(self, slots: Slots | None, segments: list[Segment], collect: dict | None = None,
                 per_row: bool = True):
        self.slots, self.segments, self.collect = slots, segments, collect
        # A decoding step (one token per slot) on a GPU: one masked attention call for all rows, as
        # launching a few kernels per row and layer would cost more than the arithmetic.
        self.batched = not per_row and slots is not None and all(
            s.length == 1 and s.slot is not None for s in segments)
        self.calls = 0  # attention calls seen: the self-check counts them
        self._masks: dict[tuple[int, int], torch.Tensor] = {}  # (queries, keys) -> mask, the same in every layer

    def attend(self, module, query, key, value, scaling) -> torch.Tensor:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self.calls += 1
        layer = module.layer_idx
        if self.collect is not None:
            self.collect[layer] = (key, value)
        if self.batched:
            return self._attend_batched(module, query, key, value, scaling)
        _, heads, total, dim = query.shape
        kv_heads = key.shape[1]
        outs, a = [], 0
        for seg in self.segments:
            b = a + seg.length
            q, k_new, v_new = query[:, :, a:b], key[:, :, a:b], value[:, :, a:b]
            if seg.slot is not None:
                assert self.slots is not None  # a segment with a slot comes with the slots
                ks, vs = self.slots.layer(layer, key)
                end = seg.start + seg.length
                ks[seg.slot, :, seg.start:end] = k_new[0]
                vs[seg.slot, :, seg.start:end] = v_new[0]
                k, v = ks[seg.slot:seg.slot + 1, :, :end], vs[seg.slot:seg.slot + 1, :, :end]
            elif seg.prefix is not None:
                k, v = seg.prefix.with_own(layer, k_new, v_new)
            else:
                k, v = k_new, v_new
            if seg.length == 1:
                # one query: grouped-query attention as one small matrix per key head, no mask
                o = F.scaled_dot_product_attention(q.reshape(1, kv_heads, heads // kv_heads, dim), k, v,
                                                   scale=scaling)
                outs.append(o.reshape(1, 1, heads, dim))
            elif k.shape[2] == seg.length:
                outs.append(sdpa_attention_forward(module, q, k, v, None, scaling=scaling, is_causal=True)[0])
            else:
                outs.append(self._attend_after(q, k, v, scaling))
            a = b
        if total > a:
            outs.append(query.new_zeros(1, total - a, heads, dim))
        return torch.cat(outs, dim=1)  # (1, tokens, heads, dim), the layout attention modules expect

    def _attend_after(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """A segment that sees every key before it and, causally, itself (bottom-right aligned). One SDPA call
        with each key head's query heads stacked as rows (keys and values are not repeated per query head)
        under an additive mask made once per pass: what sdpa_attention_forward computes with a boolean mask
        and repeated keys, up to float rounding, at a fraction of the copying."""
        _, heads, n, dim = q.shape
        kv_heads, width = k.shape[1], k.shape[2]
        groups = heads // kv_heads
        mask = self._masks.get((n, width))
        if mask is None:
            seen = torch.ones(n, width, dtype=torch.bool, device=q.device).tril(width - n)
            mask = torch.zeros(n, width, dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
            mask = self._masks[(n, width)] = mask.repeat(groups, 1)[None, None]
        o = F.scaled_dot_product_attention(q.reshape(1, kv_heads, groups * n, dim), k, v, attn_mask=mask,
                                           scale=scaling)
        return o.reshape(1, heads, n, dim).transpose(1, 2)  # (1, tokens, heads, dim)

    def _attend_batched(self, module, query, key, value, scaling) -> torch.Tensor:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        _, heads, total, dim = query.shape
        n = len(self.segments)
        assert self.slots is not None  # batched only with slots (__init__)
        ks, vs = self.slots.layer(module.layer_idx, key)
        slot_ids = torch.tensor([s.slot for s in self.segments], device=key.device)
        pos = torch.tensor([s.start for s in self.segments], device=key.device)
        ks[slot_ids, :, pos] = key[0, :, :n].transpose(0, 1)
        vs[slot_ids, :, pos] = value[0, :, :n].transpose(0, 1)
        width = max(s.start for s in self.segments) + 1
        k, v = ks.index_select(0, slot_ids)[:, :, :width], vs.index_select(0, slot_ids)[:, :, :width]
        mask = (torch.arange(width, device=key.device)[None] <= pos[:, None])[:, None, None]
        out = sdpa_attention_forward(module, query[0, :, :n].transpose(0, 1)[:, :, None], k, v, mask,
                                     scaling=scaling)[0]  # (rows, 1, heads, dim)
        out = out.reshape(1, n, heads, dim)
        if total > n:
            out = torch.cat([out, query.new_zeros(1, total - n, heads, dim)], dim=1)
        return out


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The registered attention function: the engine's own passes carry a `_Pass`; any other call
    (none is expected while the engine holds the model) is plain SDPA."""
    state = kwargs.pop(STATE_KWARG, None)
    if state is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    return state.attend(module, query, key, value, scaling), None


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention)


def _padded(n: int) -> int:
    return -(-n // ROW_QUANTUM) * ROW_QUANTUM


class PackedModel:
    """A causal LM run in packed passes; see the module docstring. `per_row`: attention row by row in
    decoding steps (outputs independent of the batch); None chooses by the model's device (CPU: yes)."""

    def __init__(self, model, per_row: bool | None = None):
        self.model = model
        self.per_row = self.device.type == "cpu" if per_row is None else per_row
        self._checked: bool | None = None
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The engine's attention selected, eval mode, no autograd; everything restored on exit."""
        _register()
        config = self.model.config
        saved_impl, saved_mode = config._attn_implementation, self.model.training
        config._attn_implementation = ATTN_NAME
        self.model.eval()
        try:
            with torch.inference_mode():
                yield
        finally:
            config._attn_implementation = saved_impl
            self.model.train(saved_mode)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def forward(self, tokens: list[int], positions: list[int], segments: list[Segment], keep: list[int],
                slots: Slots | None = None, collect: dict | None = None) -> torch.Tensor:
        """One packed pass (inside `running`): `tokens` at `positions`, cut into `segments`; the logits
        at the indices `keep`, in order. Tokens and kept rows are padded to a multiple of ROW_QUANTUM
        (see the module docstring); the padding's results are dropped."""
        n = len(tokens)
        pad = _padded(n) - n
        dev = self.device
        ids = torch.tensor([tokens + tokens[-1:] * pad], device=dev)
        pos = torch.tensor([positions + [0] * pad], device=dev)
        rows = keep + keep[-1:] * (_padded(len(keep)) - len(keep)) if keep else [n - 1]
        state = _Pass(slots, segments, collect, per_row=self.per_row)
        with self._routed(segments, n + pad):
            if self._keeps_logits:
                out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=torch.tensor(
                                 rows, device=dev), **{STATE_KWARG: state}).logits[0]
            else:
                out = self.model(input_ids=ids, position_ids=pos, use_cache=False,
                                 **{STATE_KWARG: state}).logits[0, rows]
        self._last_pass = state
        return out[: len(keep)]

    def _routed(self, segments: list[Segment], rows: int) -> contextlib.AbstractContextManager:
        """Each segment's rows through its adapter (route.py) when a segment names one; the padding rows through
        the base alone."""
        blocks: list[tuple[str | None, int, int]] = []
        a = 0
        for seg in segments:
            if blocks and blocks[-1][0] == seg.adapter and blocks[-1][2] == a:
                blocks[-1] = (seg.adapter, blocks[-1][1], a + seg.length)
            else:
                blocks.append((seg.adapter, a, a + seg.length))
            a += seg.length
        if all(name is None for name, _, _ in blocks):
            return contextlib.nullcontext()
        router = route.router_of(self.model)
        if router is None:
            raise RuntimeError("segments name adapters, but the model has no router (evals.engine.route.installed)")
        return router.route(blocks, rows, ROW_QUANTUM)

    def run_prefix(self, ids: Sequence[int], adapter: str | None = None) -> dict:
        """Keys and values (layer -> (k, v), batch 1) of `ids` at positions 0.. (inside `running`), through
        `adapter` when the model hosts several."""
        collected: dict = {}
        self.forward(list(ids), list(range(len(ids))), [Segment(0, len(ids), adapter=adapter)], [],
                     collect=collected)
        n = len(ids)
        return {layer: (k[:, :, :n], v[:, :, :n]) for layer, (k, v) in collected.items()}

    def supported(self) -> bool:
        """Whether the engine's passes give the model's own logits (checked once, on a short made-up
        prompt split into a prefix, a rest and a decoding step): False for a model whose attention does
        not go through transformers' attention interface, or that is not a plain causal LM."""
        if self._checked is None:
            self._checked = self._self_check()
        return self._checked

    def _self_check(self) -> bool:
        from transformers import PreTrainedModel

        model = self.model
        if not isinstance(model, PreTrainedModel) or not hasattr(model.config, "_attn_implementation"):
            return False
        if getattr(model.config, "is_encoder_decoder", False):
            return False
        try:
            gen = torch.Generator().manual_seed(0)
            vocab = min(int(model.config.vocab_size), 1000)
            ids = torch.randint(3, vocab, (12,), generator=gen).tolist()
            saved = model.training
            model.eval()
            try:
                with torch.inference_mode():
                    want = model(torch.tensor([ids], device=self.device)).logits[0, 8:].float()
            finally:
                model.train(saved)
            slots = Slots(2, 16)
            with self.running():
                prefix = self.run_prefix(ids[:8])
                slots.put_prefix(1, prefix, 8)
                rest = self.forward(ids[8:11], [8, 9, 10], [Segment(8, 3, slot=1)], [0, 1, 2], slots)
                calls = self._last_pass.calls
                step = self.forward(ids[11:], [11], [Segment(11, 1, slot=1)], [0], slots)
                scored = self.forward(ids[8:], [8, 9, 10, 11], [Segment(8, 4, prefix=Prefix(prefix, 8, 4))], [3])
            if not (len(prefix) == calls == self._last_pass.calls > 0):
                return False
            got = torch.cat([rest, step, scored]).float()
            want = torch.cat([want, want[-1:]])
            scale = want.abs().max().clamp_min(1.0)
            return bool(((got - want).abs().max() / scale) < 1e-3)
        except Exception:  # noqa: BLE001 - any failure means: not an architecture the engine can drive
            return False
