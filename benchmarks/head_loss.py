"""The output head and its loss alone, forward and backward: the whole-logits head against train/chunked.py.

    python benchmarks/head_loss.py [--positions 256,2048] [--vocab 49152] [--hidden 576] [--repeats 5]
        [--precision fp32,bf16]

For each number of labelled positions: milliseconds per forward and backward of
- "whole": `F.cross_entropy(hidden @ W.T)` summed, the logits and their gradient whole (what a plain head does);
- "chunked, recomputed": train/chunked.py's path for LOMO/AdaLomo (log-sum-exps kept, logits recomputed in
  backward);
- "chunked, early": its path for every other optimizer (the gradients built in forward, scaled in backward);
with the gradients of both the hidden states and the weight (fp32 weight; `bf16` = under CPU bf16 autocast, as
`train.precision: bf16` runs it), the automatic chunk. The default shape is SmolLM2-135M's head. One thread
unless OMP_NUM_THREADS says otherwise; the machine's CPU is printed. Each figure is the median of --repeats
timed calls after one untimed call.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from tunelab.train.chunked import chunked_loss


def whole(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t, reduction="sum")


PATHS = {"whole": whole,
         "chunked, recomputed": chunked_loss,
         "chunked, early": lambda h, w, t: chunked_loss(h, w, t, early=True)}


def per_call_ms(fn, positions: int, args, bf16: bool) -> float:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(positions, args.hidden, generator=gen).requires_grad_()
    w = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).requires_grad_()
    t = torch.randint(0, args.vocab, (positions,), generator=gen)

    def step():
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with ctx:
            loss = fn(h, w, t)
        loss.backward()
        h.grad = w.grad = None

    step()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--positions", default="256,2048")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--precision", default="fp32,bf16")
    args = ap.parse_args()
    print(f"CPU: {platform.processor() or platform.machine()}, threads {torch.get_num_threads()}, "
          f"torch {torch.__version__}, vocabulary {args.vocab} x hidden {args.hidden}")
    print("| precision | positions | " + " | ".join(f"{p} ms" for p in PATHS) + " | recomputed / early |")
    print("|---|---:|" + "---:|" * (len(PATHS) + 1))
    for precision in args.precision.split(","):
        for positions in (int(p) for p in args.positions.split(",")):
            ms = {name: per_call_ms(fn, positions, args, precision == "bf16") for name, fn in PATHS.items()}
            cells = " | ".join(f"{v:.1f}" for v in ms.values())
            ratio = ms["chunked, recomputed"] / ms["chunked, early"]
            print(f"| {precision} | {positions} | {cells} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
