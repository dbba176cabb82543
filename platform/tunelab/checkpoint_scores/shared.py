"""A together-group's checkpoint scores over the group's one base (#46): no base loaded again per checkpoint.

Alone, a cell scores each asked checkpoint on a model of its own (evaluate.evaluate_saved: the base loaded again,
the method applied, the checkpoint's weights over it). In a together-group (cell/group.py) the members that pause at
a rung or finish in one round hand their due checkpoints here first, and their own `settle` then finds them done:

- each checkpoint's weights (its model.pt, the alone cell's names) are copied into its member's adapter on the
  group's model for the pass, and the member's own weights put back after, bit for bit (`Swapped`); a member with
  several due checkpoints has them scored in as many passes, one checkpoint of each member a pass;
- the members whose checkpoints share an evaluation (the eval id of eval.checkpoints) and whose adapters evaluation
  can route (LoRA, DoRA, IA3 Linear layers: evals/engine/route.py) are scored in shared passes
  (evals.run_together: every row through its own adapter over the unmerged base; on CPU what alone writes, bit for
  bit); any other, one at a time over the same base with its adapter active (evals.run, unmerged);
- every step is claimed and written as the Evaluator writes it (evaluate.Evaluator.step: the step's lock, built in
  a temporary folder and renamed in), `evaluated_by` saying the group scored it. A step another process holds, an
  unreadable checkpoint, or a pass that fails is left to the member's own settle (its alone path says why).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tunelab.checkpoint_scores import evaluate
from tunelab.checkpoint_scores.steps import StepScores
from tunelab.core import events
from tunelab.core.config import CellConfig
from tunelab.core.events import Emit
from tunelab.core.files import atomic_dir, write_json
from tunelab.folders.cell import CellFolder, EvalFolder
from tunelab.machine.runtime import Preempted


@dataclass
class Asker:
    """A member whose checkpoints are due: its folder and config, its adapter's name on the group's model, the
    last step they are due up to (None: all, it finished), where its events go and its attempt's timings."""

    folder: CellFolder
    cfg: CellConfig
    adapter: str
    upto: int | None
    emit: Emit = events.ignore
    timings: dict = field(default_factory=dict)

    def due(self) -> list[int]:
        if self.cfg.eval.checkpoints is None:
            return []
        return [s for s in StepScores(self.folder, self.cfg).ready() if self.upto is None or s <= self.upto]


def score(model: Any, scoring_model: Callable[[], Any], tokenizer: Any, datasets: dict | None,
          askers: list[Asker]) -> None:
    """Every due checkpoint of these members scored over `model` (the group's PeftModel); `scoring_model()` puts it
    in eval mode and gives what the suite scores (the transformers model with the tuner layers inside)."""
    queues = {id(a): a.due() for a in askers}
    while batch := [(a, queues[id(a)].pop(0)) for a in askers if queues[id(a)]]:  # one checkpoint of each a pass
        by_eval: dict[str | None, list[tuple[Asker, int]]] = {}
        for asker, step in batch:
            by_eval.setdefault(asker.cfg.checkpoint_eval_id(), []).append((asker, step))
        for pairs in by_eval.values():
            try:
                _pass(model, scoring_model, tokenizer, datasets, pairs)
            except (Preempted, KeyboardInterrupt, SystemExit):  # a stop signal ends the group's work here
                raise
            except Exception as e:  # noqa: BLE001 - each member's own settle scores these steps (and says why not)
                print(f"together-group checkpoint scores: a shared pass failed ({type(e).__name__}: {e}); each "
                      "member scores its own", file=sys.stderr, flush=True)


def _pass(model: Any, scoring_model: Callable[[], Any], tokenizer: Any, datasets: dict | None,
          pairs: list[tuple[Asker, int]]) -> None:
    from tunelab import evals
    from tunelab.evals.engine import route
    from tunelab.train import members

    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        taken = [(a, s, out) for a, s in pairs if (out := _claim(stack, a, s)) is not None]
        if not taken:
            return
        for asker, step, _ in taken:
            stack.enter_context(Swapped(model, asker.adapter, asker.folder.checkpoint_dir(step)))
        names = [a.adapter for a, _, _ in taken]
        contexts = [evaluate.context(a.folder, out, datasets) for a, _, out in taken]
        scorer = scoring_model()  # after the swaps: eval mode, no DoRA cache of another checkpoint's weights
        ecfg = taken[0][0].cfg.eval.at_checkpoints()
        shared = len(taken) > 1 and route.unroutable(model, names) is None
        if shared:
            def emit(ev: events.Event) -> None:
                for a, s, _ in taken:
                    evaluate.tagged(a.emit, s)(ev)

            outs = evals.run_together(scorer, tokenizer, ecfg, contexts, names, emit)
        else:
            outs = []
            for (asker, step, _), ctx in zip(taken, contexts):
                members.activate(model, asker.adapter)
                outs.append(evals.run(scorer, tokenizer, ecfg, ctx, evaluate.tagged(asker.emit, step)))
        spent = time.perf_counter() - t0
        how = f"the together-group, in shared passes with {len(taken)} adapters" if shared else \
            "the together-group, over its base"
        for (asker, step, out), res in zip(taken, outs):
            by = f"{how}, {'after training' if asker.upto is None else f'paused at step {asker.upto}'}"
            write_json(EvalFolder(out).results_file, {**res, **evaluate.mark(asker.folder, step, by),
                                                      "seconds": spent})
            asker.timings["checkpoints_s"] = asker.timings.get("checkpoints_s", 0.0) + spent / len(taken)
    evaluate.say(f"steps {', '.join(f'{a.folder.path.name}:{s}' for a, s, _ in taken)} evaluated in "
                 f"{spent:.1f} s ({how})")


def _claim(stack: contextlib.ExitStack, asker: Asker, step: int) -> Any:
    """The step's lock and its temporary folder (renamed in when the pass ends well), or None: another evaluator
    has it, or it is done, or its checkpoint is gone."""
    eval_id = asker.cfg.checkpoint_eval_id()
    assert eval_id is not None
    claim = asker.folder.step_claim(eval_id, step)
    if not claim.acquire(wait=0):
        return None
    stack.callback(claim.release)
    if StepScores(asker.folder, asker.cfg).done(step) or not asker.folder.checkpoint_dir(step).is_dir():
        return None
    evaluate.clear_halves(asker.folder, eval_id, step)
    return stack.enter_context(atomic_dir(asker.folder.step_dir(eval_id, step)))


class Swapped(contextlib.AbstractContextManager):
    """A checkpoint's weights in a member's adapter while the block runs; the member's own put back after, bit
    for bit (they are its optimizer's parameters)."""

    def __init__(self, model: Any, adapter: str, step_dir: Any):
        self.model, self.adapter, self.step_dir = model, adapter, step_dir
        self.own: dict[str, torch.Tensor] = {}

    def __enter__(self) -> Swapped:
        from tunelab.core.errors import UserError
        from tunelab.train.members import alone_key

        params = {alone_key(n, self.adapter): p for n, p in self.model.named_parameters()
                  if f".{self.adapter}." in n + "."}
        path = self.step_dir / "model.pt"
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - said as the alone path says it
            raise UserError(f"checkpoint weights unreadable ({type(e).__name__})", file=path) from e
        if set(saved) != set(params):
            raise UserError(f"checkpoint weights do not match member {self.adapter}'s adapter", file=path)
        with torch.no_grad():
            for key, p in params.items():
                self.own[key] = p.detach().clone()
                p.copy_(saved[key])
        self.params = params
        return self

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for key, value in self.own.items():
                self.params[key].copy_(value)

