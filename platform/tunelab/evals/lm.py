"""lm-eval's HFLM around a model already in memory, with log-likelihoods that share few-shot prefixes.

Every question of an MMLU subject starts with the same description and five solved dev questions:
about 90% of its tokens. HFLM runs them all again for every question. `SharedPrefixLM` runs each
shared prefix once, keeps its key/value cache, and runs only the rest of each question against it
(batched, right-padded, sorted by length); inputs whose continuation logits can be read off one
forward pass (the one-token answers " A".." D") are computed once. The log-probabilities are those
of HFLM up to float rounding; generation is HFLM's own.
"""

from __future__ import annotations

import copy
import inspect
from collections import defaultdict

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM

MIN_SHARED = 32  # tokens: below this a shared prefix is not worth a separate forward pass


def _lcp(a: tuple, b: tuple) -> int:
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


class SharedPrefixLM(HFLM):
    """HFLM(pretrained=model, tokenizer=tokenizer) for a model in memory; see the module docstring."""

    def __init__(self, model, tokenizer, batch_size: int = 8, share_prefixes: bool = True, **kwargs):
        super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, **kwargs)
        # Prefix caches need a plain transformers causal LM (a PEFT wrapper may own the cache).
        from transformers import PreTrainedModel

        self.share_prefixes = share_prefixes and isinstance(model, PreTrainedModel) and self.backend == "causal"
        # transformers 5 renamed forward's past_key_values to cache; older models keep the old name
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keeps_logits = "logits_to_keep" in params

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        if not self.share_prefixes:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
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
        for shared, members in groups_by_prefix(unique):
            seqs = [unique[i] for i in members]
            # The prefix may not reach into any position whose logits are scored.
            p = min([shared] + [len(s) - need[s] for s in seqs])
            if len(members) == 1 or p < MIN_SHARED:
                p = 0
            logprobs.update(self._score_group(seqs, p, need))
        out = []
        for (req_str, _, cont), inp, n in zip(requests, inputs, contlens):
            lp = logprobs[inp][-n:]
            target = torch.tensor(cont[-n:], device=lp.device)
            answer = (float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
            out.append(answer)
            if req_str is not None:
                self.cache_hook.add_partial("loglikelihood", req_str, answer)
        return out

    @torch.no_grad()
    def _score_group(self, seqs: list[tuple], p: int, need: dict) -> dict[tuple, torch.Tensor]:
        cache = None
        if p:
            prefix = torch.tensor([seqs[0][:p]], device=self.device)
            # Only the cache is wanted: skip the vocabulary projection of every prefix position.
            keep = {"logits_to_keep": 1} if self._keeps_logits else {}
            cache = getattr(self.model(prefix, use_cache=True, **keep), self._cache_arg)
        bs = self.batch_size if isinstance(self.batch_size, int) and self.batch_size > 0 else 8
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))  # batch by length
        out = {}
        for start in range(0, len(order), bs):
            batch = [seqs[i] for i in order[start:start + bs]]
            width = max(len(s) for s in batch) - p
            ids = torch.full((len(batch), width), self.tokenizer.pad_token_id or 0, device=self.device)
            for row, s in enumerate(batch):
                ids[row, : len(s) - p] = torch.tensor(s[p:], device=self.device)
            kwargs = {}
            if cache is not None:
                batch_cache = copy.deepcopy(cache)  # the forward pass appends to it
                batch_cache.batch_repeat_interleave(len(batch))
                kwargs = {self._cache_arg: batch_cache, "use_cache": True}
            # Right padding under a causal mask: real tokens never see the pads, as in HFLM.
            logits = self.model(ids, **kwargs).logits
            for row, s in enumerate(batch):
                end = len(s) - p
                out[s] = F.log_softmax(logits[row, end - need[s]: end], dim=-1, dtype=self.softmax_dtype)
        return out
