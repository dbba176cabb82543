"""lm-eval's HFLM around a model already in memory, with few-shot prefixes computed once.

Every question of an MMLU subject starts with the same description and five solved dev questions:
about 90% of its tokens; every GSM8K question with the same 8 solved exemplars, every question of a
BBH task with its 3. HFLM runs them all again for every question.

`SharedPrefixLM` runs every forward pass on tunelab's engine (`evals/engine/packed.py`, `evals/engine/generate.py`):

- log-likelihoods: each shared prefix runs once; the rest of each question runs against its keys and
  values, `batch_size` questions to a packed pass (no padding), the output head only at the scored
  positions; inputs whose continuation logits can be read off one pass (the one-token answers
  " A".." D") run once. The log-probabilities are HFLM's up to float rounding.
- generation (`generate_until`): each prefix once, continuous batching, every row stopping at its own
  stop string; contexts encoded, stopped, decoded and cut exactly as HFLM does, so greedy outputs are
  HFLM's up to float rounding (a near-tie can flip).
- perplexity (`loglikelihood_rolling`): HFLM's own rolling windows, scored as log-likelihood requests above
  (every position of a window).

`served` counts the requests of each type by the code that served them (the engine, or HFLM and why), for
results.json.

HFLM's own code runs where the engine does not serve: `share_prefixes=False`, a model that fails the
engine's self-check, and generation requests with sampling or other generation arguments.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM

from tunelab.evals.engine.generate import MIN_SHARED, Decoder, Request, generation_config_issue, groups_by_prefix
from tunelab.evals.engine.packed import Prefix, Segment

__all__ = ["MIN_SHARED", "SharedPrefixLM", "groups_by_prefix"]

# generate_until arguments the engine honours; with do_sample false HFLM ignores the sampling ones too
_ENGINE_GEN_KWARGS = {"do_sample", "temperature", "top_p", "top_k"}


class SharedPrefixLM(HFLM):
    """HFLM(pretrained=model, tokenizer=tokenizer) for a model in memory; see the module docstring.

    `adapters`: the model hosts several PEFT adapters of one base (evals/engine/route.py, installed): every call
    is answered for each of them, in shared passes where the engine serves it; lm-eval gets the first adapter's
    answers and `others` holds the rest's (evals/lmeval/fanout.py replays them)."""

    def __init__(self, model, tokenizer, batch_size: int = 8, share_prefixes: bool = True,
                 adapters: list[str] | None = None, **kwargs):
        super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, **kwargs)
        self.share_prefixes = share_prefixes and self.backend == "causal"
        self._decoder: Decoder | None = None
        # progress(done, total) over the requests of the current call (the runner's eval bar); HFLM's own
        # code, where it runs, shows its tqdm bar in the cell's log instead
        self.progress: Callable[[int, int], None] | None = None
        # requests served, by (request type, "engine" or "hf: why"): results.json says which code ran
        self.served: Counter[tuple[str, str]] = Counter()
        self._kind = "loglikelihood"  # the request type `_loglikelihood_tokens` is serving (rolling: windows)
        self.adapters: list[str | None] = list(adapters) if adapters else [None]
        self.others: list[list] = []  # the last call's answers for adapters[1:]
        self._single = False  # inside `_each`: one adapter at a time, routed to it as a whole
        self._quiet = False  # `_each` beyond its first adapter: the requests are counted once

    def engine(self) -> Decoder | None:
        """tunelab's engine for this model, or None where HFLM's own code must run (share_prefixes off, a
        model the engine cannot drive: see `Decoder.supported`)."""
        if not self.share_prefixes:
            return None
        if self._decoder is None:
            # decoding slots for every adapter's rows: the passes of a step share the weights' reads
            self._decoder = Decoder(self.model, self.tokenizer, batch_size=self._batch() * len(self.adapters))
        return self._decoder if self._decoder.supported() else None

    def _batch(self) -> int:
        return self.batch_size if isinstance(self.batch_size, int) and self.batch_size > 0 else 8

    def _count(self, kind: str, path: str, n: int) -> None:
        if not self._quiet:
            self.served[kind, path] += n

    def _each(self, compute: Callable[[], list]) -> list[list]:
        """`compute()` once per adapter, every row routed to it (HFLM's own code, rolling windows): one answer list
        per adapter. Each starts from the random state of the first, so sampled draws are each adapter's alone."""
        if self.adapters == [None] or self._single:
            return [compute()]
        from tunelab.evals.engine import route

        router = route.router_of(self.model)
        assert router is not None, "several adapters need evals.engine.route.installed(model)"
        devices = list(range(torch.cuda.device_count()))
        cpu, gpus = torch.random.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]
        out = []
        self._single = True
        try:
            for k, name in enumerate(self.adapters):
                self._quiet = k > 0
                with router.only(name), torch.random.fork_rng(devices=devices, enabled=k > 0):
                    if k:
                        torch.random.set_rng_state(cpu)
                        for d, state in zip(devices, gpus):
                            torch.cuda.set_rng_state(state, d)
                    out.append(compute())
        finally:
            self._single = self._quiet = False
        return out

    def _first(self, per_adapter: list[list]) -> list:
        self.others = per_adapter[1:]
        return per_adapter[0]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return self._first(self._generate(requests, disable_tqdm))

    def _generate(self, requests, disable_tqdm: bool) -> list[list[str]]:
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

        hf_generate = super().generate_until
        decoder = self.engine()
        why = self._hf_reason(decoder, generate=True)
        if why:
            self._count("generate_until", f"hf: {why}", len(requests))
            return self._each(lambda: hf_generate(requests, disable_tqdm=disable_tqdm))
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        mine, stops, theirs = {}, {}, []
        for i, inst in enumerate(requests):
            context, gen_kwargs = inst.args
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = kwargs.pop("max_gen_toks")
            if kwargs.get("do_sample") or set(kwargs) - _ENGINE_GEN_KWARGS:
                theirs.append(i)
                continue
            # HFLM's encoding of a generation context: its own tok_batch_encode, left-truncated so that the
            # context and the new tokens fit in max_length.
            assert self.max_length - max_gen > 0, f"max_gen_toks {max_gen} leaves no room in {self.max_length}"
            ids, _ = self.tok_batch_encode([context], left_truncate_len=self.max_length - max_gen,
                                           truncation=self.truncation)
            mine[i] = Request(tuple(ids[0].tolist()), max_gen, tuple(until))
            stops[i] = until
        out: list[list[str | None]] = [[None] * len(requests) for _ in self.adapters]
        self._count("generate_until", "engine", len(mine))
        if theirs:
            self._count("generate_until", "hf: sampling or generation arguments the engine does not take", len(theirs))
            for k, texts in enumerate(self._each(lambda: hf_generate([requests[i] for i in theirs], disable_tqdm))):
                for i, text in zip(theirs, texts):
                    out[k][i] = text
        order = list(mine)
        assert decoder is not None  # _hf_reason names why when there is no engine
        decoder.progress = self.progress
        # every adapter's requests in one generation: each row through its own adapter (route.py)
        results = decoder.generate([replace(mine[i], adapter=name) for name in self.adapters for i in order])
        for at, result in enumerate(results):
            k, j = divmod(at, len(order))
            i = order[j]  # the request's own index: the calls HFLM serves (`theirs`) may sit anywhere among them
            text = postprocess_generated_text(self.tok_decode(result.tokens), stops[i], None)
            if k == 0:
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
            out[k][i] = text
        return out  # type: ignore[return-value]

    def _hf_reason(self, decoder: Decoder | None, generate: bool = False) -> str:
        """Why HFLM's own code serves a call ("" when the engine does)."""
        if decoder is None:
            return "share_prefixes off" if not self.share_prefixes else "the model failed the engine's self-check"
        if generate and getattr(self, "think_end_token", None) is not None:
            return "think_end_token"
        return (generation_config_issue(self.model) or "") if generate else ""

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Perplexity: HFLM cuts each document into its rolling windows and scores them through
        `_loglikelihood_tokens`, that is on the engine's packed passes (every position of a window scored);
        with several adapters, one adapter after another."""
        hf_rolling = super().loglikelihood_rolling
        self._kind = "loglikelihood_rolling"
        try:
            return self._first(self._each(lambda: hf_rolling(requests, disable_tqdm=disable_tqdm)))
        finally:
            self._kind = "loglikelihood"

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        hf_tokens = super()._loglikelihood_tokens
        decoder = self.engine()
        kind = self._kind
        if decoder is None:
            self._count(kind, f"hf: {self._hf_reason(decoder)}", len(requests))
            return self._first(self._each(lambda: hf_tokens(requests, disable_tqdm=disable_tqdm,
                                                            override_bs=override_bs)))
        self._count(kind, "engine", len(requests))
        adapters: list[str | None] = [None] if self._single else self.adapters
        # The model input of a request, exactly as HFLM builds it (left-truncated to max_length).
        inputs, contlens = [], []
        by_input: dict[tuple, list[int]] = defaultdict(list)
        for i, (_, ctx, cont) in enumerate(requests):
            inputs.append(tuple((ctx + cont)[-(self.max_length + 1):][:-1]))
            contlens.append(len(cont))
            by_input[inputs[-1]].append(i)
        # One forward pass serves every request with the same input: keep the longest continuation.
        need: dict[tuple, int] = defaultdict(int)
        for inp, n in zip(inputs, contlens):
            need[inp] = max(need[inp], n)
        unique = list(need)
        out: list[list] = [[None] * len(requests) for _ in adapters]
        done = 0
        with decoder.running():
            # The prefix may not reach into any position whose logits are scored.
            for p, members in _pooled(decoder.plan(unique, own=[need[s] for s in unique])):
                for k, seq, lp in self._score_group(decoder, [unique[i] for i in members], p, need, adapters):
                    for i in by_input[seq]:  # each request's answer now: the log-softmax rows are not kept
                        out[k][i] = _answer(lp[-contlens[i]:], requests[i][2])
                    done += 1
                    if self.progress is not None:
                        self.progress(done, len(unique) * len(adapters))
        for (req_str, _, _), answer in zip(requests, out[0]):
            if req_str is not None:
                self.cache_hook.add_partial("loglikelihood", req_str, answer)
        return self._first(out)

    def _score_group(self, decoder: Decoder, seqs: list[tuple], p: int, need: dict,
                     adapters: list[str | None]) -> Iterator[tuple[int, tuple, torch.Tensor]]:
        """(adapter index, sequence, log-softmax over its last need[s] positions) for every sequence and adapter:
        the shared prefix runs once per adapter, the sequences' own tokens `batch_size` at a time in packed
        passes against it, each attending to the prefix and to itself only (no padding: a sequence's numbers do
        not depend on its neighbours, nor on the other adapters' rows beside it), and the output head runs at
        the scored positions only."""
        # room for the group's longest sequence, whatever the batch: the buffers' strides, and so their rounding
        room = max(len(s) for s in seqs) - p
        prefixes = {a: Prefix(decoder.run_prefix(seqs[0][:p], a), p, room) for a in adapters} if p else {}
        pairs = [(k, s) for k in range(len(adapters)) for s in seqs]
        step = self._batch()
        for start in range(0, len(pairs), step):
            batch = pairs[start:start + step]
            segments = []
            tokens: list[int] = []
            positions: list[int] = []
            keep: list = []
            for k, s in batch:
                tokens += s[p:]
                positions += range(p, len(s))
                segments.append(Segment(p, len(s) - p, prefix=prefixes.get(adapters[k]), adapter=adapters[k]))
                keep += range(len(tokens) - need[s], len(tokens))
            logits = decoder.forward(tokens, positions, segments, keep)
            at = 0
            for k, s in batch:
                yield k, s, F.log_softmax(logits[at:at + need[s]], dim=-1, dtype=self.softmax_dtype)
                at += need[s]


def _answer(lp: torch.Tensor, cont: list[int]) -> tuple[float, bool]:
    """(log-likelihood of continuation `cont`, whether it is the greedy one) from its log-softmax rows `lp`."""
    target = torch.tensor(cont, device=lp.device)
    return float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())


def _pooled(plan: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
    """The plan with every request that shares no prefix in one group: they then fill packed passes together
    (`batch_size` at a time) instead of a pass each (0-shot multiple choice: every choice is its own request).
    A request's numbers do not depend on the others in its pass, so this changes no result."""
    alone = sorted(i for p, members in plan if not p for i in members)
    return [(p, members) for p, members in plan if p] + ([(0, alone)] if alone else [])
