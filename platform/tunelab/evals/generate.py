"""The decoding engine behind tunelab's generation tasks (GSM8K, BBH through lm-eval; HumanEval).

What it saves over `model.generate` on a padded batch:

- **Shared prefixes run once.** Requests are grouped by a common token prefix (GSM8K's 8 exemplars,
  a BBH task's 3, the same HumanEval prompt sampled n times). A group's prefix runs through the model
  once; each request's own tokens then run against the prefix's keys and values.
- **Every row stops on its own.** Decoding is continuous: a row leaves the batch at its stop string,
  end-of-sequence token or length limit, and the next waiting request takes its slot. Nothing waits
  for the longest row of a batch, and no row is left-padded.
- **Keys and values are written in place** into a per-slot buffer, not concatenated at every step.

Outputs do not depend on the batch size, by construction where possible and by measurement where
not (tests/test_eval_generate.py checks batch sizes 1, 4 and 16):

- a request's own tokens run through the model alone (no padding, shapes set by the request);
- attention is computed row by row over exactly that row's keys (no padded key positions, whose
  masked zeros would change how the softmax and the weighted sum are blocked and rounded);
- the matrix products of a decoding step see every row in the batch, and on CPU MKL's sgemm rounds a
  row differently when a thread gets fewer than 4 rows (measured: 1, 2 and 3 rows differ from 4 or
  more, at any position in the batch). So a step always runs a multiple of `ROW_QUANTUM` rows,
  padding with idle rows whose results are dropped;
- sampling draws from one generator per request, seeded from the request, never from the batch.

The model's own modules do the work: the engine registers an attention function with transformers
(`AttentionInterface`) and selects it for its own forward passes only; that function reads and
writes the slot buffers. A model whose attention does not go through that interface is detected by a
self-check on first use (`Decoder.supported`) and callers fall back to `model.generate`.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

MIN_SHARED = 32  # tokens: below this a shared prefix is not worth a separate forward pass
ROW_QUANTUM = 8  # a decoding step runs a multiple of this many rows; see the module docstring
ATTN_NAME = "tunelab_slots"
STATE_KWARG = "tunelab_slots"


def _lcp(a: Sequence, b: Sequence) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def groups_by_prefix(seqs: list[tuple], min_shared: int = MIN_SHARED) -> list[tuple[int, list[int]]]:
    """Partition sequence indices into groups that share a prefix of at least `min_shared` tokens:
    [(prefix length, [index ...])]. Lexicographic order puts sequences with long common prefixes
    next to each other, and a group's common prefix is the minimum over its neighbours."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i])
    out: list[tuple[int, list[int]]] = []
    for i in order:
        if out:
            shared, members = out[-1]
            common = min(shared, _lcp(seqs[members[-1]], seqs[i]))
            if common >= min_shared:
                out[-1] = (common, [*members, i])
                continue
        out.append((len(seqs[i]), [i]))
    return out


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first occurrence of any non-empty stop string."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=len(text))
    return text[:cut]


@dataclass(frozen=True)
class Request:
    """One completion to generate. `temperature` 0 is greedy; otherwise pure temperature sampling
    (no top-k or top-p) from a generator seeded with `seed`, so a request's draws depend only on it.

    A stop string is looked for in the generated text; with `stop_in_prompt`, also across the end of
    the prompt (a stop string that starts in the prompt and ends in the completion, as transformers'
    `stop_strings` does: HumanEval's "\n#" after a prompt that ends in a newline). lm-eval's HFLM looks
    at generated tokens only."""

    ids: tuple[int, ...]
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    seed: int = 0
    stop_in_prompt: bool = False


@dataclass
class Output:
    tokens: list[int]  # generated ids, up to and including the one that completed a stop string or EOS
    reason: str  # "stop" (a stop string), "eos" or "length"


@dataclass
class _Row:
    index: int  # into the request list
    req: Request
    slot: int
    length: int  # tokens in the slot's cache
    window: int  # tokens of generated text in which a stop string is looked for
    gen: torch.Generator | None
    tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Segment:
    """A run of consecutive tokens of one sequence inside a packed forward pass.

    `start` is the position of its first token. With a `slot`, its keys and values are written into that
    slot at [start, start + length) and it attends to the slot's first start + length positions (the slot
    already holds the earlier ones). Without one, it attends to `prefix` (layer -> (keys, values) of the
    positions before `start`, or None when start is 0) and to itself, and nothing is kept."""

    start: int
    length: int
    slot: int | None = None
    prefix: dict | None = None


class _Slots:
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

    def __init__(self, slots: _Slots | None, segments: list[Segment], collect: dict | None = None,
                 per_row: bool = True):
        self.slots, self.segments, self.collect = slots, segments, collect
        # A decoding step (one token per slot) on a GPU: one masked attention call for all rows, as
        # launching a few kernels per row and layer would cost more than the arithmetic.
        self.batched = not per_row and slots is not None and all(
            s.length == 1 and s.slot is not None for s in segments)
        self.calls = 0  # attention calls seen: the self-check counts them

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
                ks, vs = self.slots.layer(layer, key)
                end = seg.start + seg.length
                ks[seg.slot, :, seg.start:end] = k_new[0]
                vs[seg.slot, :, seg.start:end] = v_new[0]
                k, v = ks[seg.slot:seg.slot + 1, :, :end], vs[seg.slot:seg.slot + 1, :, :end]
            elif seg.prefix is not None:
                pk, pv = seg.prefix[layer]
                k, v = torch.cat([pk, k_new], dim=2), torch.cat([pv, v_new], dim=2)
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
                # the segment sees everything before it and, causally, itself (bottom-right aligned)
                mask = torch.ones(seg.length, k.shape[2], dtype=torch.bool, device=q.device)
                mask = mask.tril(k.shape[2] - seg.length)[None, None]
                outs.append(sdpa_attention_forward(module, q, k, v, mask, scaling=scaling)[0])
            a = b
        if total > a:
            outs.append(query.new_zeros(1, total - a, heads, dim))
        return torch.cat(outs, dim=1)  # (1, tokens, heads, dim), the layout attention modules expect

    def _attend_batched(self, module, query, key, value, scaling) -> torch.Tensor:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        _, heads, total, dim = query.shape
        n = len(self.segments)
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


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_NAME, _attention)
        _registered = True


def eos_ids(model, tokenizer) -> set[int]:
    """The token ids `model.generate` stops at: the generation config's, else the tokenizer's."""
    config = getattr(model, "generation_config", None)
    ids = getattr(config, "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return set()
    return {int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])}


def _padded(n: int) -> int:
    return -(-n // ROW_QUANTUM) * ROW_QUANTUM


# Generation-config settings that change greedy decoding, with their neutral values: a model whose
# config sets any of them is left to `model.generate`, which applies them.
_GREEDY_CHANGERS = {"min_length": 0, "min_new_tokens": 0, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                    "bad_words_ids": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
                    "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None,
                    "exponential_decay_length_penalty": None, "num_beams": 1, "guidance_scale": 1.0}


def generation_config_issue(model) -> str | None:
    """Why `model.generate` would decode differently from the engine (a setting above), or None."""
    config = getattr(model, "generation_config", None)
    for key, neutral in _GREEDY_CHANGERS.items():
        value = getattr(config, key, None)
        if value is not None and value != neutral and value != []:
            return f"generation_config.{key}={value!r}"
    return None


class Decoder:
    """Generates completions (and scores continuations, see `logits`) for many requests with a model in
    memory; see the module docstring.

    `batch_size` is the number of rows decoded together (slots). The model is put in eval mode and its
    attention implementation switched to the engine's only while the engine runs it."""

    def __init__(self, model, tokenizer, *, batch_size: int = 8, min_shared: int = MIN_SHARED,
                 stop_eos: set[int] | None = None, per_row: bool | None = None):
        self.model, self.tokenizer = model, tokenizer
        # Row-by-row attention in decoding steps (outputs independent of the batch) on CPU; one batched
        # call on a GPU, where per-row kernel launches would dominate (and GPU kernels' rounding depends
        # on shapes anyway). None: by the model's device.
        self.per_row = self.device.type == "cpu" if per_row is None else per_row
        self.batch_size = max(1, int(batch_size))
        self.min_shared = min_shared
        self.eos = eos_ids(model, tokenizer) if stop_eos is None else set(stop_eos)
        self._checked: bool | None = None
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    # -- model plumbing -----------------------------------------------------------------------------

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
                slots: _Slots | None = None, collect: dict | None = None) -> torch.Tensor:
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
        if self._keeps_logits:
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=torch.tensor(rows,
                             device=dev), **{STATE_KWARG: state}).logits[0]
        else:
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False, **{STATE_KWARG: state}).logits[0, rows]
        self._last_pass = state
        return out[: len(keep)]

    def run_prefix(self, ids: Sequence[int]) -> dict:
        """Keys and values (layer -> (k, v), batch 1) of `ids` at positions 0.. (inside `running`)."""
        collected: dict = {}
        self.forward(list(ids), list(range(len(ids))), [Segment(0, len(ids))], [], collect=collected)
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
            slots = _Slots(2, 16)
            with self.running():
                prefix = self.run_prefix(ids[:8])
                slots.put_prefix(1, prefix, 8)
                rest = self.forward(ids[8:11], [8, 9, 10], [Segment(8, 3, slot=1)], [0, 1, 2], slots)
                calls = self._last_pass.calls
                step = self.forward(ids[11:], [11], [Segment(11, 1, slot=1)], [0], slots)
                scored = self.forward(ids[8:], [8, 9, 10, 11], [Segment(8, 4, prefix=prefix)], [3])
            if not (len(prefix) == calls == self._last_pass.calls > 0):
                return False
            got = torch.cat([rest, step, scored]).float()
            want = torch.cat([want, want[-1:]])
            scale = want.abs().max().clamp_min(1.0)
            return bool(((got - want).abs().max() / scale) < 1e-3)
        except Exception:  # noqa: BLE001 - any failure means: not an architecture the engine can drive
            return False

    # -- decoding -----------------------------------------------------------------------------------

    def _window(self, stops: Sequence[str]) -> int:
        """Tokens of generated text searched for a stop string after each step: enough to hold the
        longest stop string even at one character per token, plus slack for tokens that straddle it.
        A stop string that is missed (longer than the window in tokens) only costs time: the text is
        cut at its first stop string at the end anyway."""
        return max((len(s) for s in stops), default=0) + 4

    def _choose(self, logits: torch.Tensor, row: _Row) -> int:
        if row.gen is None:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float().cpu() / row.req.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=row.gen))

    def _finished(self, row: _Row) -> str | None:
        tok = row.tokens[-1]
        if tok in self.eos:
            return "eos"
        if row.req.stop and self._stopped(row):
            return "stop"
        if len(row.tokens) >= row.req.max_new_tokens:
            return "length"
        return None

    def _stopped(self, row: _Row) -> bool:
        """Whether a stop string ends in the generated text (searched in its last `row.window` tokens,
        and in the prompt's last tokens while fewer have been generated, with `stop_in_prompt`)."""
        decode = self.tokenizer.decode
        context = row.req.ids[-(row.window - len(row.tokens)):] if row.req.stop_in_prompt else ()
        if len(row.tokens) >= row.window:
            context = ()
        skip = len(decode(context, skip_special_tokens=False)) if context else 0
        text = decode([*context, *row.tokens[-row.window:]], skip_special_tokens=False)
        return any(s and text.find(s, max(0, skip - len(s) + 1)) >= 0 for s in row.req.stop)

    def plan(self, seqs: list[tuple], own: list[int] | None = None) -> list[tuple[int, list[int]]]:
        """[(prefix length, member indices in order)]: groups of sequences that share a prefix worth
        running once (0: none). A prefix leaves each sequence at least `own[i]` tokens (default 1) of its
        own: the positions whose logits are wanted come from its own pass."""
        out = []
        for shared, members in groups_by_prefix(seqs, self.min_shared):
            p = min([shared] + [len(seqs[m]) - (own[m] if own else 1) for m in members])
            out.append((p if len(members) > 1 and p >= self.min_shared else 0, sorted(members)))
        return out

    def generate(self, requests: Sequence[Request]) -> list[Output]:
        """One Output per request, in order."""
        results: list[Output | None] = [None] * len(requests)
        todo = [i for i, r in enumerate(requests) if r.max_new_tokens > 0 and len(r.ids) > 0]
        for i in set(range(len(requests))) - set(todo):
            results[i] = Output([], "length")
        if not todo:
            return results  # type: ignore[return-value]
        queue: list[tuple[int, int, int]] = []  # (group, prefix length, request index) in admission order
        for g, (p, members) in enumerate(self.plan([tuple(requests[i].ids) for i in todo])):
            queue.extend((g, p, todo[m]) for m in members)
        remaining = collections.Counter(g for g, _, _ in queue)
        longest = max(len(requests[i].ids) for i in todo) + 1
        slots = _Slots(self.batch_size, longest + min(max(requests[i].max_new_tokens for i in todo), 256))
        free = list(range(self.batch_size))
        active: list[_Row] = []
        prefixes: dict[int, dict] = {}
        with self.running():
            pos = 0
            while pos < len(queue) or active:
                admit = []
                while free and pos < len(queue):
                    admit.append((*queue[pos], free.pop(0)))
                    pos += 1
                rows = self._step(active, slots) + self._admit(requests, admit, slots, prefixes, remaining)
                active = []
                for row in rows:
                    if (reason := self._finished(row)) is not None:
                        results[row.index] = Output(row.tokens, reason)
                        free.append(row.slot)
                    else:
                        active.append(row)
                free.sort()
        return results  # type: ignore[return-value]

    def _admit(self, requests, admit: list[tuple[int, int, int, int]], slots: _Slots, prefixes: dict,
               remaining: collections.Counter) -> list[_Row]:
        """Put requests in free slots: a group's prefix runs once (on its first member) and is copied into
        each member's slot; the members' own tokens run in one packed pass, which gives their first
        tokens."""
        if not admit:
            return []
        rows, tokens, positions, segments, keep = [], [], [], [], []
        for g, p, i, slot in admit:
            req = requests[i]
            if p and g not in prefixes:
                prefixes[g] = self.run_prefix(req.ids[:p])
            slots.ensure(len(req.ids) + 1)
            if p:
                slots.put_prefix(slot, prefixes[g], p)
            remaining[g] -= 1
            if remaining[g] == 0:
                prefixes.pop(g, None)  # every member has its copy
            own = list(req.ids[p:])
            segments.append(Segment(p, len(own), slot=slot))
            tokens += own
            positions += range(p, len(req.ids))
            keep.append(len(tokens) - 1)
            gen = torch.Generator().manual_seed(int(req.seed) & 0xFFFF_FFFF_FFFF_FFFF) if req.temperature > 0 else None
            rows.append(_Row(i, req, slot, len(req.ids), self._window(req.stop), gen))
        logits = self.forward(tokens, positions, segments, keep, slots)
        for row, row_logits in zip(rows, logits):
            row.tokens.append(self._choose(row_logits, row))
        return rows

    def _step(self, active: list[_Row], slots: _Slots) -> list[_Row]:
        """One decoding step for every active row: one token each, packed into one pass."""
        if not active:
            return []
        slots.ensure(max(r.length for r in active) + 1)
        logits = self.forward([r.tokens[-1] for r in active], [r.length for r in active],
                              [Segment(r.length, 1, slot=r.slot) for r in active], list(range(len(active))), slots)
        for row, row_logits in zip(active, logits):
            row.length += 1
            row.tokens.append(self._choose(row_logits, row))
        return active


@dataclass(frozen=True)
class Divergence:
    """Where a greedy completion first leaves `model.generate`'s at batch size 1, and by how much:
    `gap` is |logit(ours) - logit(theirs)| at that step, from a plain forward pass of the model over
    the prompt and the common tokens. A near-tie (gap of float-rounding size) explains a difference."""

    step: int
    ours: int
    theirs: int
    gap: float


@torch.inference_mode()
def first_divergence(model, ids: Sequence[int], ours: Sequence[int], max_new_tokens: int) -> Divergence | None:
    """Compare `ours` (greedy tokens generated after `ids`) with `model.generate`'s greedy tokens for the
    same prompt at batch size 1 (lm-eval's hf model decodes so); None when one is a prefix of the
    other (the same tokens, stopped at different points)."""
    device = next(model.parameters()).device
    prompt = torch.tensor([list(ids)], device=device)
    saved = model.training
    model.eval()
    try:
        theirs = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=getattr(model.generation_config, "pad_token_id", None)
                                or 0)[0, prompt.shape[1]:].tolist()
        step = _lcp(list(ours), theirs)
        if step >= min(len(ours), len(theirs)):
            return None
        logits = model(torch.tensor([[*ids, *ours[:step]]], device=device)).logits[0, -1].float()
    finally:
        model.train(saved)
    return Divergence(step, int(ours[step]), int(theirs[step]), abs(float(logits[ours[step]] - logits[theirs[step]])))
