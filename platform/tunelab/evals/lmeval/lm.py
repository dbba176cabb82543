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
from collections.abc import Callable

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM

from tunelab.evals.engine.generate import MIN_SHARED, Decoder, Request, generation_config_issue, groups_by_prefix
from tunelab.evals.engine.packed import Prefix, Segment

__all__ = ["MIN_SHARED", "SharedPrefixLM", "groups_by_prefix"]

# generate_until arguments the engine honours; with do_sample false HFLM ignores the sampling ones too
_ENGINE_GEN_KWARGS = {"do_sample", "temperature", "top_p", "top_k"}


class SharedPrefixLM(HFLM):
    """HFLM(pretrained=model, tokenizer=tokenizer) for a model in memory; see the module docstring."""

    def __init__(self, model, tokenizer, batch_size: int = 8, share_prefixes: bool = True, **kwargs):
        super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, **kwargs)
        self.share_prefixes = share_prefixes and self.backend == "causal"
        self._decoder: Decoder | None = None
        # progress(done, total) over the requests of the current call (the runner's eval bar); HFLM's own
        # code, where it runs, shows its tqdm bar in the cell's log instead
        self.progress: Callable[[int, int], None] | None = None
        # requests served, by (request type, "engine" or "hf: why"): results.json says which code ran
        self.served: Counter[tuple[str, str]] = Counter()
        self._kind = "loglikelihood"  # the request type `_loglikelihood_tokens` is serving (rolling: windows)

    def engine(self) -> Decoder | None:
        """tunelab's engine for this model, or None where HFLM's own code must run (share_prefixes off, a
        model the engine cannot drive: see `Decoder.supported`)."""
        if not self.share_prefixes:
            return None
        if self._decoder is None:
            bs = self.batch_size if isinstance(self.batch_size, int) and self.batch_size > 0 else 8
            self._decoder = Decoder(self.model, self.tokenizer, batch_size=bs)
        return self._decoder if self._decoder.supported() else None

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

        decoder = self.engine()
        why = self._hf_reason(decoder, generate=True)
        if why:
            self.served["generate_until", f"hf: {why}"] += len(requests)
            return super().generate_until(requests, disable_tqdm=disable_tqdm)
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
        out: list[str | None] = [None] * len(requests)
        self.served["generate_until", "engine"] += len(mine)
        if theirs:
            self.served["generate_until", "hf: sampling or generation arguments the engine does not take"] += len(
                theirs)
            for i, text in zip(theirs, super().generate_until([requests[i] for i in theirs], disable_tqdm)):
                out[i] = text
        order = list(mine)
        assert decoder is not None  # _hf_reason names why when there is no engine
        decoder.progress = self.progress
        for i, result in zip(order, decoder.generate([mine[i] for i in order])):
            text = postprocess_generated_text(self.tok_decode(result.tokens), stops[i], None)
            self.cache_hook.add_partial("generate_until", requests[i].args, text)
            out[i] = text
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
        `_loglikelihood_tokens`, that is on the engine's packed passes (every position of a window scored)."""
        self._kind = "loglikelihood_rolling"
        try:
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
        finally:
            self._kind = "loglikelihood"

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        decoder = self.engine()
        kind = self._kind
        if decoder is None:
            self.served[kind, f"hf: {self._hf_reason(decoder)}"] += len(requests)
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        self.served[kind, "engine"] += len(requests)
        # The model input of a request, exactly as HFLM builds it (left-truncated to max_length).
        inputs, contlens = [], []
        for _, ctx, cont in requests:
            inputs.append(tuple((ctx + cont)[-(self.max_length + 1):][:-1]))
            contlens.append(len(cont))
        # One forward pass serves every request with the same input: keep the longest continuation.
        need: dict[tuple, int] = defaultdict(int)
        for inp, n in zip(inputs, contlens):
            need[inp] = max(need[inp], n)
        unique = list(need)
        logprobs: dict[tuple, torch.Tensor] = {}  # input -> log-softmax over its last `need` positions
        with decoder.running():
            # The prefix may not reach into any position whose logits are scored.
            for p, members in _pooled(decoder.plan(unique, own=[need[s] for s in unique])):
                logprobs.update(self._score_group(decoder, [unique[i] for i in members], p, need))
                if self.progress is not None:
                    self.progress(len(logprobs), len(unique))
        out = []
        for (req_str, _, cont), inp, n in zip(requests, inputs, contlens):
            lp = logprobs[inp][-n:]
            target = torch.tensor(cont[-n:], device=lp.device)
            answer = (float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
            out.append(answer)
            if req_str is not None:
                self.cache_hook.add_partial("loglikelihood", req_str, answer)
        return out

    def _score_group(self, decoder: Decoder, seqs: list[tuple], p: int, need: dict) -> dict[tuple, torch.Tensor]:
        """Log-softmax over the last need[s] positions of each sequence: the shared prefix runs once, the
        sequences' own tokens `batch_size` at a time in packed passes against it, each attending to the
        prefix and to itself only (no padding: a sequence's numbers do not depend on its neighbours), and
        the output head runs at the scored positions only."""
        # room for the group's longest sequence, whatever the batch: the buffers' strides, and so their rounding
        prefix = Prefix(decoder.run_prefix(seqs[0][:p]), p, max(len(s) for s in seqs) - p) if p else None
        out = {}
        for start in range(0, len(seqs), decoder.batch_size):
            batch = seqs[start:start + decoder.batch_size]
            segments = []
            tokens: list[int] = []
            positions: list[int] = []
            keep: list = []
            for s in batch:
                tokens += s[p:]
                positions += range(p, len(s))
                segments.append(Segment(p, len(s) - p, prefix=prefix))
                keep += range(len(tokens) - need[s], len(tokens))
            logits = decoder.forward(tokens, positions, segments, keep)
            at = 0
            for s in batch:
                out[s] = F.log_softmax(logits[at:at + need[s]], dim=-1, dtype=self.softmax_dtype)
                at += need[s]
        return out


def _pooled(plan: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
    """The plan with every request that shares no prefix in one group: they then fill packed passes together
    (`batch_size` at a time) instead of a pass each (0-shot multiple choice: every choice is its own request).
    A request's numbers do not depend on the others in its pass, so this changes no result."""
    alone = sorted(i for p, members in plan if not p for i in members)
    return [(p, members) for p, members in plan if p] + ([(0, alone)] if alone else [])
