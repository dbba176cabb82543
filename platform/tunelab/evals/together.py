"""Several PEFT adapters of one frozen base scored together: one eval section, one pass over the model per request,
one results.json per adapter, each what evaluating that adapter alone writes.

The entry point, for a process that holds one base with several adapters on it (a together-group's worker,
`exp eval run BASE --adapters CELL...`):

    results = evals.run_together(model, tokenizer, cfg, contexts, adapters, emit)

- `model`: the transformers model (or the PeftModel around it) hosting every adapter, unmerged: LoRA, DoRA or IA3
  tuner layers on Linear modules of the body, several tuner types nested on one module allowed (peft's
  `inject_adapter_in_model`, `train.peft.load_adapters`). `evals.engine.route.unroutable(model, adapters)` says
  beforehand why a set of adapters cannot be scored together (then evaluate each alone: `evals.run` on
  `train.peft.for_eval` of its own model).
- `adapters[k]`: adapter k's name on the model; `contexts[k]`: its `evals.Context` (its own out_dir, validation
  and training sets, val_loss already measured, model note), exactly as `evals.run` would get it alone.
- `cfg`: the one eval section they share. `emit`: EvalTask / EvalProgress events of the group (one bar).
- Returns one results dict per adapter, in order; each is also written to contexts[k].out_dir as results.json
  (after each task) with its samples.jsonl.

What is shared: lm-eval tasks (fanout.py: each loglikelihood / generate_until call answered for every adapter in
the same packed passes, lm-eval then run once per adapter over the answers), HumanEval (every adapter's requests
in one generation, each adapter's programs run in the sandbox as alone). Every other task (val_loss, a registered
task without a `together` fact) runs once per adapter with every row routed to it.

Equal to alone: each row goes through its own adapter over the unmerged base, as `train.peft.for_eval` evaluates a
cell alone, and a row's numbers do not depend on the rows beside it (evals/engine/route.py): on CPU at the tests'
sizes log-likelihoods, generated strings and val_loss are bit for bit alone's (tests/test_eval_together.py); where
kernels split their sums by shape (larger models, several threads, a GPU) they agree in the last bits (SmolLM2's
quick suite on 2 CPU threads: log-likelihoods within 9.3e-6, every generated string the same:
benchmarks/README.md), and generated strings up to near-ties. results.json differs from alone's by `together` (the
group it was scored in) and `seconds` (the group's wall time for the task).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tunelab.core.errors import UserError
from tunelab.core.events import Emit, EvalTask, ignore
from tunelab.evals import suite
from tunelab.evals.suite import TASKS, Context

if TYPE_CHECKING:
    from tunelab.evals.engine.route import Router


@dataclass
class Group:
    """The adapters scored together and their contexts, for a task's `together` function."""

    adapters: list[str]
    contexts: list[Context]
    router: Router
    progress: Any = None  # (done, total) of the running task, for the group
    _lm: Any = field(default=None, repr=False)

    def lm(self, model, tokenizer, cfg):
        """The lm-eval wrapper answering for every adapter, built once and shared by every lm-eval task."""
        if self._lm is None:
            from tunelab.evals.lmeval.fanout import FanOutLM

            self._lm = FanOutLM(model, tokenizer, self.adapters, batch_size=cfg.batch_size)
        return self._lm


def run_together(model, tokenizer, cfg, contexts: list[Context], adapters: list[str],
                 emit: Emit = ignore) -> list[dict]:
    """Score every task of `cfg` for each adapter of `model`, in shared passes; see the module docstring."""
    if len(contexts) != len(adapters) or len(set(adapters)) != len(adapters) or not adapters:
        raise ValueError(f"{len(adapters)} adapters (distinct, at least one) need as many contexts, "
                         f"not {len(contexts)}")
    from tunelab.evals.engine import route

    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    tokenizer = suite.private(tokenizer)
    if why := route.unroutable(model, adapters):
        raise UserError(f"these adapters cannot be evaluated together: {why}; evaluate each alone")
    note = {"adapters": len(adapters), "seconds": "each task's wall time for the whole group"}
    with route.installed(model) as router:
        group = Group(list(adapters), list(contexts), router)
        outs = [suite.begin(cfg, ctx, tokenizer, together={**note, "member": k}) for k, ctx in enumerate(contexts)]
        for name in cfg.tasks:
            emit(EvalTask(name))
            group.progress = suite.throttled(emit, name)
            t0 = time.perf_counter()
            results = _task(name, model, tokenizer, cfg, group)
            seconds = time.perf_counter() - t0
            for out, ctx, res in zip(outs, contexts, results):
                suite.record(out, ctx, name, res, seconds)
        return [suite.finish(out, ctx) for out, ctx in zip(outs, contexts)]


def _task(name: str, model, tokenizer, cfg, group: Group) -> list[dict]:
    spec = TASKS[name] if name in TASKS else None
    if spec is None or spec.harness is not None:
        return harness_together(name, model, tokenizer, cfg, group)
    if spec.together is not None:
        return spec.together.load()(name, model, tokenizer, cfg, group)
    results = []
    for adapter, ctx in zip(group.adapters, group.contexts):  # one adapter at a time, every row routed to it
        ctx.progress = group.progress
        with group.router.only(adapter):
            results.append(spec.run.load()(name, model, tokenizer, cfg, ctx))
    return results


def harness_together(name, model, tokenizer, cfg, group: Group) -> list[dict]:
    """An lm-eval task, built once: lm-eval runs it for the first adapter against the group's FanOutLM (every call
    answered for all adapters at once), then for each other adapter over the answers kept (fanout.py)."""
    from tunelab.evals.lmeval import harness

    lm = group.lm(model, tokenizer, cfg)
    results = []
    with harness.prepared(name, cfg) as setup:
        for k, ctx in enumerate(group.contexts):
            lm.serve(k)
            ctx.progress = group.progress if k == 0 else None  # the other adapters' runs compute nothing
            results.append(suite.harness_scores(name, lm, tokenizer, cfg, ctx, setup))
    return results


def humaneval_together(name, model, tokenizer, cfg, group: Group) -> list[dict]:
    """HumanEval: every adapter's completions in one generation, then each adapter's programs in the sandbox."""
    from tunelab.evals import humaneval
    from tunelab.evals.sandbox import contain

    found = suite.humaneval_problems(name, cfg)
    if isinstance(found, dict):
        return [dict(found) for _ in group.adapters]
    contain.require(cfg.allow_unsandboxed)  # before generating, as alone
    problems, source = found
    problems = humaneval.load_problems(cfg.limit_for(name)) if problems is None else problems[:cfg.limit_for(name)]
    completions = humaneval.generate_each(
        model, tokenizer, [p["prompt"] for p in problems], group.adapters, max_new_tokens=cfg.max_new_tokens or 256,
        batch_size=cfg.batch_size, n_samples=cfg.n_samples, temperature=cfg.temperature, progress=group.progress)
    return [suite.humaneval_result(humaneval.report(problems, done, n_samples=cfg.n_samples, timeout_s=cfg.timeout_s,
                                                    samples_path=ctx.samples_file,
                                                    allow_unsandboxed=cfg.allow_unsandboxed), source)
            for done, ctx in zip(completions, group.contexts)]
