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

import contextlib
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


class _Pass:
    """What the attention function does during one forward pass; passed to it as a keyword argument."""

    def __init__(self, slots: _Slots, mode: str, *, slot: int = 0, start: int = 0,
                 rows: list[tuple[int, int]] | None = None, prefix: dict | None = None):
        self.slots, self.mode, self.slot, self.start = slots, mode, slot, start
        self.rows = rows or []  # decode: (slot, position of the new token) per real row
        self.prefix = prefix  # prefix mode: layer -> (keys, values) collected here
        self.calls = 0  # attention calls seen: the self-check counts them

    def attend(self, module, query, key, value, scaling) -> torch.Tensor:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self.calls += 1
        layer = module.layer_idx
        if self.mode == "prefix":
            self.prefix[layer] = (key, value)
            out, _ = sdpa_attention_forward(module, query, key, value, None, scaling=scaling, is_causal=True)
            return out
        ks, vs = self.slots.layer(layer, key)
        if self.mode == "prefill":
            m, end = key.shape[2], self.start + key.shape[2]
            ks[self.slot, :, self.start:end] = key[0]
            vs[self.slot, :, self.start:end] = value[0]
            k, v = ks[self.slot:self.slot + 1, :, :end], vs[self.slot:self.slot + 1, :, :end]
            if self.start == 0:
                out, _ = sdpa_attention_forward(module, query, k, v, None, scaling=scaling, is_causal=True)
                return out
            # The new tokens see the whole prefix and, causally, each other (bottom-right aligned).
            mask = torch.ones(m, end, dtype=torch.bool, device=query.device).tril(self.start)
            out, _ = sdpa_attention_forward(module, query, k, v, mask[None, None], scaling=scaling)
            return out
        # decode: one new token per row; rows past len(self.rows) are padding
        n = len(self.rows)
        slot_ids = torch.tensor([s for s, _ in self.rows], device=key.device)
        pos_ids = torch.tensor([p for _, p in self.rows], device=key.device)
        ks[slot_ids, :, pos_ids] = key[:n, :, 0]
        vs[slot_ids, :, pos_ids] = value[:n, :, 0]
        batch, heads, _, dim = query.shape
        kv_heads = key.shape[1]
        group = heads // kv_heads
        outs = []
        for i, (s, p) in enumerate(self.rows):
            # grouped-query attention as one small matrix per key head: (1, kv_heads, group, dim)
            q = query[i].reshape(1, kv_heads, group, dim)
            o = F.scaled_dot_product_attention(q, ks[s:s + 1, :, :p + 1], vs[s:s + 1, :, :p + 1], scale=scaling)
            outs.append(o.reshape(heads, dim))
        outs.extend([query.new_zeros(heads, dim)] * (batch - n))
        return torch.stack(outs)[:, None]  # (batch, 1, heads, dim), the layout attention modules expect


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
    """Generates completions for many requests with a model in memory; see the module docstring.

    `batch_size` is the number of rows decoded together (slots). The model is put in eval mode and
    its attention implementation switched to the engine's only inside `generate`."""

    def __init__(self, model, tokenizer, *, batch_size: int = 8, min_shared: int = MIN_SHARED,
                 stop_eos: set[int] | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.batch_size = max(1, int(batch_size))
        self.min_shared = min_shared
        self.eos = eos_ids(model, tokenizer) if stop_eos is None else set(stop_eos)
        self._checked: bool | None = None
        self._stop_lengths: dict[str, int] = {}

    # -- model plumbing -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _engine_attention(self) -> Iterator[None]:
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

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, state: _Pass, last_only: bool) -> torch.Tensor:
        kwargs = {"logits_to_keep": 1} if last_only else {}
        out = self.model(input_ids=ids, position_ids=positions, use_cache=False, **{STATE_KWARG: state}, **kwargs)
        return out.logits

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def supported(self) -> bool:
        """Whether the engine's passes give the model's own logits (checked once, on a short made-up
        prompt split into a prefix and a rest): False for a model whose attention does not go through
        transformers' attention interface, or that is not a plain causal LM."""
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
            ids = torch.randint(3, vocab, (1, 12), generator=gen).to(self.device)
            saved = model.training
            model.eval()
            try:
                with torch.inference_mode():
                    want = model(ids).logits[0, -3:].float()
            finally:
                model.train(saved)
            slots = _Slots(1, 16)
            with self._engine_attention():
                prefix: dict = {}
                pos = torch.arange(12, device=self.device)[None]
                first = _Pass(slots, "prefix", prefix=prefix)
                self._forward(ids[:, :8], pos[:, :8], first, last_only=True)
                self._copy_prefix(slots, prefix, 0, 8)
                rest = _Pass(slots, "prefill", slot=0, start=8)
                got_prefill = self._forward(ids[:, 8:11], pos[:, 8:11], rest, last_only=False)[0, -2:].float()
                step = _Pass(slots, "decode", rows=[(0, 11)])
                ids_step = ids[:, 11:12].expand(ROW_QUANTUM, 1)
                got_step = self._forward(ids_step, pos[:, 11:12].expand(ROW_QUANTUM, 1), step, last_only=False)[0]
            n_layers = len(prefix)
            if not (first.calls == rest.calls == step.calls == n_layers > 0):
                return False
            got = torch.cat([got_prefill, got_step.float()])
            scale = want.abs().max().clamp_min(1.0)
            return bool(((got - want).abs().max() / scale) < 1e-3)
        except Exception:  # noqa: BLE001 - any failure means: not an architecture the engine can drive
            return False

    @staticmethod
    def _copy_prefix(slots: _Slots, prefix: dict, slot: int, p: int) -> None:
        for layer, (k, v) in prefix.items():
            ks, vs = slots.layer(layer, k)
            ks[slot, :, :p] = k[0, :, :p]
            vs[slot, :, :p] = v[0, :, :p]

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

    def generate(self, requests: Sequence[Request]) -> list[Output]:
        """One Output per request, in order."""
        results: list[Output | None] = [None] * len(requests)
        todo = [i for i, r in enumerate(requests) if r.max_new_tokens > 0 and len(r.ids) > 0]
        for i in set(range(len(requests))) - set(todo):
            results[i] = Output([], "length")
        if not todo:
            return results  # type: ignore[return-value]
        seqs = [tuple(requests[i].ids) for i in todo]
        # A prefix must leave each member at least one token of its own: the logits of its last prompt
        # token come from its own pass.
        queue: list[tuple[int, int]] = []  # (group number, request index) in admission order
        prefix_len: list[int] = []
        for g, (shared, members) in enumerate(groups_by_prefix(seqs, self.min_shared)):
            p = min([shared] + [len(seqs[m]) - 1 for m in members])
            prefix_len.append(p if len(members) > 1 and p >= self.min_shared else 0)
            queue.extend((g, todo[m]) for m in sorted(members))
        remaining = {g: 0 for g in range(len(prefix_len))}
        for g, _ in queue:
            remaining[g] += 1
        longest = max(len(requests[i].ids) for i in todo) + 1
        slots = _Slots(self.batch_size, min(longest + max(requests[i].max_new_tokens for i in todo), longest + 256))
        free = list(range(self.batch_size))
        active: list[_Row] = []
        prefixes: dict[int, dict] = {}
        with self._engine_attention():
            pos = 0
            while pos < len(queue) or active:
                while free and pos < len(queue):
                    g, i = queue[pos]
                    pos += 1
                    row = self._admit(requests[i], i, g, prefix_len[g], free.pop(0), slots, prefixes)
                    remaining[g] -= 1
                    if remaining[g] == 0:
                        prefixes.pop(g, None)  # every member has its copy
                    if (reason := self._finished(row)) is not None:
                        results[i] = Output(row.tokens, reason)
                        free.append(row.slot)
                    else:
                        active.append(row)
                if not active:
                    continue
                self._step(active, slots)
                still = []
                for row in active:
                    if (reason := self._finished(row)) is not None:
                        results[row.index] = Output(row.tokens, reason)
                        free.append(row.slot)
                    else:
                        still.append(row)
                active = still
                free.sort()
        return results  # type: ignore[return-value]

    def _admit(self, req: Request, index: int, group: int, p: int, slot: int, slots: _Slots,
               prefixes: dict[int, dict]) -> _Row:
        """Put a request in a slot: the group's prefix (run once, on its first member) is copied in,
        the request's own tokens run alone, and its first token is chosen."""
        dev = self.device
        ids = torch.tensor(req.ids, device=dev)[None]
        slots.ensure(len(req.ids) + 1)
        if p and group not in prefixes:
            collected: dict = {}
            self._forward(ids[:, :p], torch.arange(p, device=dev)[None], _Pass(slots, "prefix", prefix=collected),
                          last_only=True)
            prefixes[group] = collected
        if p:
            self._copy_prefix(slots, prefixes[group], slot, p)
        n = len(req.ids)
        logits = self._forward(ids[:, p:], torch.arange(p, n, device=dev)[None],
                               _Pass(slots, "prefill", slot=slot, start=p), last_only=True)[0, -1]
        gen = None
        if req.temperature > 0:
            gen = torch.Generator().manual_seed(int(req.seed) & 0xFFFF_FFFF_FFFF_FFFF)
        row = _Row(index, req, slot, n, self._window(req.stop), gen)
        row.tokens.append(self._choose(logits, row))
        return row

    def _step(self, active: list[_Row], slots: _Slots) -> None:
        """One decoding step for every active row (padded to a multiple of ROW_QUANTUM rows)."""
        dev = self.device
        slots.ensure(max(r.length for r in active) + 1)
        n = len(active)
        padded = -(-n // ROW_QUANTUM) * ROW_QUANTUM
        toks = [r.tokens[-1] for r in active] + [active[0].tokens[-1]] * (padded - n)
        pos = [r.length for r in active] + [active[0].length] * (padded - n)
        state = _Pass(slots, "decode", rows=[(r.slot, r.length) for r in active])
        logits = self._forward(torch.tensor(toks, device=dev)[:, None], torch.tensor(pos, device=dev)[:, None],
                               state, last_only=False)[:, -1]
        for i, row in enumerate(active):
            row.length += 1
            row.tokens.append(self._choose(logits[i], row))


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
