"""CPU attention under bf16 autocast: torch's bf16 SDPA against SDPA in fp32 (with the casts), forward and backward.

    python benchmarks/sdpa_cpu.py [--rows 4] [--heads 9] [--dim 64] [--keys 64,128,256,512,1024] [--repeats 20]

What train/cpu_attention.py's SHORT_KEYS rests on: for each number of keys, milliseconds per forward and
backward of causal SDPA (`is_causal`, and with a boolean mask, as padded batches are attended), on bf16
inputs, and on the same inputs cast to fp32 with the output cast back (what cpu_attention does). One thread
unless OMP_NUM_THREADS says otherwise; the machine's CPU is printed.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F


def per_call_ms(keys: int, args, upcast: bool, masked: bool) -> float:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(args.rows, args.heads, keys, args.dim, generator=gen, dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))
    mask = torch.ones(args.rows, 1, keys, keys, dtype=torch.bool).tril() if masked else None

    def step() -> None:
        a, b, c = (t.float() for t in (q, k, v)) if upcast else (q, k, v)
        out = F.scaled_dot_product_attention(a, b, c, attn_mask=mask, is_causal=mask is None).to(torch.bfloat16)
        out.sum().backward()

    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        step()
    return (time.perf_counter() - t0) / args.repeats * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--keys", default="64,128,256,512,1024")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"{cpu}; torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.rows} rows x {args.heads} "
          f"heads x {args.dim} dims, forward + backward, ms per call")
    print("| keys | attention | bf16 | fp32 (with casts) | bf16 / fp32 |\n|---:|---|---:|---:|---:|")
    for keys in (int(k) for k in args.keys.split(",")):
        for masked in (False, True):
            half, full = (per_call_ms(keys, args, up, masked) for up in (False, True))
            print(f"| {keys} | {'boolean mask' if masked else 'is_causal'} | {half:.1f} | {full:.1f} | "
                  f"{half / full:.2f} |")


if __name__ == "__main__":
    main()
