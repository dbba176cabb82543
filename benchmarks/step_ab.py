"""tunelab's training step against the plain one in one process, batch by batch: `train_throughput.py` without its
process-to-process noise.

    python benchmarks/step_ab.py [--model NAME] [--batches 8] [--repeats 5] [--precision fp32|bf16] [--chunk N ...]
                                  [--compile]

On a shared VM two fresh processes timed minutes apart can differ by 10-60% in speed (benchmarks/README.md), more
than the gap being measured. Here two copies of one model train side by side in one process on the same
length-grouped Alpaca-shaped batches (train_throughput.py's data, every 6th of the first 6 x --batches batches, so
they span the lengths), and the two steps alternate batch by batch (their order flipped every repeat), so a change
in the machine's speed hits both alike:
- "plain": what Trainer's step does: `model(**batch).loss` (the whole-vocabulary head and log-softmax at every
  position), backward, clip at 1.0, torch's fused AdamW, gradients set to None;
- "tunelab": the one-process stepper as `train.run` builds it (train/parallel/steppers.prepare: lean norms and
  MLPs, the head and loss at labelled positions in chunks with its gradients built in forward, the tied
  embedding's one gradient buffer, the same clip and fused AdamW), stepped by `LocalStepper.train_step`.
`--chunk N` adds a contender: tunelab's step with `train.loss_chunk: N` (positions per chunk of the head; the
default is automatic, 64 MiB of fp32 logits and a temporary: 170 positions at SmolLM2's 49,152 words).
`--compile` adds both steps compiled (torch.compile, dynamic shapes): the plain step's whole model (its loss
included) as Trainer's `torch_compile=True` compiles it, tunelab's with `train.compile: true` (its decoder body);
both warmed up on every batch so that compiling stays outside the timing.
The untimed steps' losses are printed and must agree (relative 1e-4 in fp32, 2e-2 in bf16; else exit 1).
Prints each repeat's seconds per side and the median ratio (plain / tunelab: above 1, tunelab is faster). This is
a diagnostic of the step alone; the headline peer is Trainer as its own entry point runs it (train_throughput.py).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))


def batches(args, tok) -> list[dict]:
    import train_throughput as tt

    from tunelab.data.build import build
    from tunelab.train.data import loader
    from tunelab.train.loop import BatchStream

    work = Path(tempfile.mkdtemp())
    spec = SimpleNamespace(model=args.model, recipe=tt.alpaca_recipe(work, 2000), max_length=256, steps=1,
                           batch=4, precision=args.precision)
    cfg = tt.make_cfg(spec, "cpu", grouped=True)
    stream = BatchStream(loader(build(cfg.data, tok, work)["train"], 4, tok.pad_token_id, shuffle=True,
                                seed=cfg.train.seed, group_by_length=True))
    return [next(stream) for _ in range(6 * args.batches)][::6]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: smollm2-135m-instruct when cached, else tiny")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--chunk", type=int, nargs="*", default=[], help="also time tunelab at these loss_chunk values")
    p.add_argument("--compile", action="store_true",
                   help="also both steps compiled: the plain one's whole model, tunelab's train.compile")
    args = p.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    import torch
    import train_throughput as tt

    from tunelab.core.config import ModelCfg
    from tunelab.machine.runtime import Layout
    from tunelab.models import loading
    from tunelab.train import optim, parallel
    from tunelab.train.data import label_tokens
    from tunelab.train.parallel.local import autocast

    args.model = args.model or tt.default_model()
    base, tok = loading.load(ModelCfg.model_validate({"name": args.model, "dtype": "float32", "attn": "sdpa"}), "cpu")
    data = batches(args, tok)
    cell = tt.make_cfg(SimpleNamespace(model=args.model, recipe="arithmetic", max_length=256, steps=1, batch=4,
                                       precision=args.precision), "cpu")
    device = torch.device("cpu")

    def fresh():
        return copy.deepcopy(base).train()

    def tunelab_step(chunk: int | None, compiled: bool = False):
        train = cell.train.model_copy(update={"loss_chunk": chunk, "compile": compiled})
        c = cell.model_copy(update={"train": train})
        stepper = parallel.prepare(fresh(), lambda ps: optim.build(ps, c.optim, max_grad_norm=1.0, fused_kernel=True),
                                   c, Layout(device=device), args.precision)
        return lambda b: stepper.train_step([b], label_tokens(b))[0]

    def plain_step(compiled: bool = False):
        model = fresh()
        if compiled:  # the whole model, its loss included, as Trainer's torch_compile=True compiles it
            model.compile(dynamic=True)
        opt = torch.optim.AdamW(model.parameters(), lr=cell.optim.lr, fused=True)

        def step(batch):
            n = torch.as_tensor(label_tokens(batch))
            with autocast(args.precision, device):
                loss = model(**batch, num_items_in_batch=n, use_cache=False).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())
        return step

    steps = {"plain": plain_step(), "tunelab": tunelab_step(None)}
    steps.update({f"tunelab chunk {n}": tunelab_step(n) for n in args.chunk})
    if args.compile:
        steps.update({"plain compiled": plain_step(True), "tunelab compiled": tunelab_step(None, True)})
    # First-call costs outside the timing. The copies start from the same weights, so their untimed losses
    # (before and after updates) must agree: the two sides compute the same step, or there is nothing to compare.
    warm = {name: [fn(b) for b in (data if 'compiled' in name else data[:2])] for name, fn in steps.items()}
    tol = 1e-4 if args.precision == "fp32" else 2e-2
    print("untimed steps' losses: " + "; ".join(f"{n} {', '.join(f'{x:.6f}' for x in v)}" for n, v in warm.items()))
    if any(abs(x - y) > tol * abs(y) for v in warm.values() for x, y in zip(v, warm["plain"])):
        print(f"the steps' losses differ by more than {tol:g} (relative): not the same computation", file=sys.stderr)
        return 1
    tokens = sum(int(b["attention_mask"].sum()) for b in data)
    print(f"{args.model}, {args.precision}, {len(data)} grouped batches of 4 rows ({tokens} tokens, lengths "
          f"{[b['input_ids'].shape[1] for b in data]}), {torch.get_num_threads()} threads", flush=True)
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for rep in range(args.repeats):
        took = dict.fromkeys(steps, 0.0)
        for b in data:
            for name in (list(steps) if rep % 2 == 0 else list(steps)[::-1]):
                t = time.perf_counter()
                steps[name](b)
                took[name] += time.perf_counter() - t
        for name, s in took.items():
            seconds[name].append(s)
        print(f"repeat {rep + 1}: " + ", ".join(f"{name} {s:.2f} s" for name, s in took.items())
              + "; plain / " + ", ".join(f"{name} {took['plain'] / s:.3f}" for name, s in took.items()
                                         if name != "plain"), flush=True)
    pairs = [("plain", n) for n in steps if n != "plain"]
    if args.compile:
        pairs.append(("plain compiled", "tunelab compiled"))
    for a, b in pairs:
        ratios = [x / y for x, y in zip(seconds[a], seconds[b])]
        print(f"median: {a} {statistics.median(seconds[a]):.2f} s, {b} {statistics.median(seconds[b]):.2f} s; "
              f"ratio {a} / {b} {statistics.median(ratios):.3f} (each repeat {min(ratios):.3f}-{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
