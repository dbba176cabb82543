"""One lm-eval task scored for several PEFT adapters of one base: the model runs once, lm-eval once per adapter.

What lm-eval asks of a model (its requests) depends on the task and the eval section, never on the model: every
adapter of a group sharing an eval section gets the same requests in the same order. So lm-eval runs the task for
the first adapter against a `FanOutLM`, whose every call (loglikelihood, loglikelihood_rolling, generate_until) is
answered for all the adapters at once, in shared passes (lm.py, the rows routed by evals/engine/route.py); it
returns the first adapter's answers and keeps the others'. lm-eval then runs the same task again for each other
adapter (`serve(k)`), and every call is answered from what was kept, after checking that lm-eval asked for the
same requests. Each adapter's lm-eval output (metrics, samples, `served`) is then what evaluating it alone gives.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tunelab.evals.lmeval.lm import SharedPrefixLM


@dataclass
class _Call:
    kind: str  # the request type
    args: list  # lm-eval's arguments of every request, in order
    answers: list[list]  # per adapter
    served: Counter  # SharedPrefixLM.served's increase: which code served the requests


class FanOutLM(SharedPrefixLM):
    """SharedPrefixLM answering for `adapters` at once; see the module docstring. `serve(0)` before lm-eval's run of
    a task for the first adapter, `serve(k)` before its run for adapter k."""

    def __init__(self, model, tokenizer, adapters: list[str], batch_size: int = 8, **kwargs):
        super().__init__(model, tokenizer, batch_size=batch_size, adapters=adapters, **kwargs)
        self.member = 0
        self._calls: list[_Call] = []
        self._next = 0

    def serve(self, member: int) -> None:
        """lm-eval's next run is adapter `member`'s (0: a new task, answered by the model)."""
        self.member, self._next = member, 0
        if member == 0:
            self._calls = []

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return self._fan("loglikelihood", requests, lambda: super(FanOutLM, self).loglikelihood(requests, disable_tqdm))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return self._fan("loglikelihood_rolling", requests,
                         lambda: super(FanOutLM, self).loglikelihood_rolling(requests, disable_tqdm))

    def generate_until(self, requests, disable_tqdm: bool = False):
        return self._fan("generate_until", requests,
                         lambda: super(FanOutLM, self).generate_until(requests, disable_tqdm))

    def _fan(self, kind: str, requests, compute) -> list:
        args = [r.args for r in requests]
        if self.member == 0:
            before = Counter(self.served)
            first = compute()
            self._calls.append(_Call(kind, args, [first, *self.others], Counter(self.served) - before))
            return first
        if self._next >= len(self._calls) or self._calls[self._next].kind != kind \
                or self._calls[self._next].args != args:
            raise RuntimeError(f"lm-eval asked adapter {self.adapters[self.member]!r} for other {kind} requests "
                               "than the first adapter: its answers cannot be shared")
        call = self._calls[self._next]
        self._next += 1
        self.served.update(call.served)
        return call.answers[self.member]
