"""CPU attention under bf16 autocast: torch's bf16 SDPA against SDPA in fp32 (with the casts), forward and backward.

    python benchmarks/sdpa_cpu.py [--rows 4] [--heads 9] [--dim 64] [--keys 64,128,256,512,1024] [--repeats 20]

What train/cpu_attention.py's SHORT_KEYS rests on: for each number of keys, milliseconds per forward and
backward of causal SDPA (`is_causal`, and with a boolean mask, as padded batches are attended), on bf16
inputs, and on the same inputs cast to fp32 with the output cast back (what cpu_attention does). Also
transformers' eager attention (its `eager_attention_forward`, additive mask, softmax in fp32) under bf16
autocast and in fp32, the other implementation Trainer's users can pick (benchmarks/train_throughput.py sweeps
it). One thread unless OMP_NUM_THREADS says otherwise; the machine's CPU is printed.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F


def timed_ms(step, repeats: int) -> float:
    """Milliseconds per call of `step`, after 3 untimed calls."""
    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - t0) / repeats * 1000


def per_call_ms(keys: int, args, upcast: bool, masked: bool, dtype: torch.dtype = torch.bfloat16) -> float:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(args.rows, args.heads, keys, args.dim, generator=gen, dtype=dtype)
               .requires_grad_() for _ in range(3))
    mask = torch.ones(args.rows, 1, keys, keys, dtype=torch.bool).tril() if masked else None

    def step() -> None:
        a, b, c = (t.float() for t in (q, k, v)) if upcast else (q, k, v)
        out = F.scaled_dot_product_attention(a, b, c, attn_mask=mask, is_causal=mask is None).to(dtype)
        out.sum().backward()

    return timed_ms(step, args.repeats)


def eager_ms(keys: int, args, autocast: bool) -> float:
    """transformers' eager attention, forward and backward, with its causal additive mask."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, eager_attention_forward

    module = LlamaAttention(LlamaConfig(hidden_size=args.heads * args.dim, num_attention_heads=args.heads,
                                        num_key_value_heads=args.heads, head_dim=args.dim), layer_idx=0)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(args.rows, args.heads, keys, args.dim, generator=gen).requires_grad_() for _ in range(3))
    mask = torch.zeros(args.rows, 1, keys, keys).masked_fill(~torch.ones(keys, keys, dtype=torch.bool).tril(),
                                                             float("-inf"))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = eager_attention_forward(module, q, k, v, mask, scaling=args.dim ** -0.5)[0]
        out.float().sum().backward()

    return timed_ms(step, args.repeats)


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
    print("| keys | SDPA | bf16 SDPA | fp32 SDPA (with casts) | bf16 / fp32 |\n|---:|---|---:|---:|---:|")
    for keys in (int(k) for k in args.keys.split(",")):
        for masked in (False, True):
            half, full = (per_call_ms(keys, args, up, masked) for up in (False, True))
            print(f"| {keys} | {'boolean mask' if masked else 'is_causal'} | {half:.1f} | {full:.1f} | "
                  f"{half / full:.2f} |")
    print("\n| keys | eager, bf16 autocast | eager, fp32 | SDPA, fp32 (boolean mask, no casts) |\n"
          "|---:|---:|---:|---:|")
    for keys in (int(k) for k in args.keys.split(",")):
        print(f"| {keys} | {eager_ms(keys, args, True):.1f} | {eager_ms(keys, args, False):.1f} | "
              f"{per_call_ms(keys, args, True, True, dtype=torch.float32):.1f} |")


if __name__ == "__main__":
    main()
