"""Tokens/s of one training step per parallel layout (native engine and DeepSpeed ZeRO).

    python benchmarks/parallel_scaling.py [--max-procs 4] [--steps 4] [--hidden 256] [--layers 4]

Each layout runs under `torchrun` with its own process count: gloo on CPU (OMP_NUM_THREADS=1
per process), nccl and one GPU per process when CUDA is there; the same script runs unchanged
on both. Prints a markdown table; the first step of each layout is warm-up and not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = {
    "1 process": {},
    "dp2 (FSDP2)": {"dp": 2},
    "tp2": {"tp": 2},
    "pp2 (1f1b)": {"pp": 2, "microbatches": 2},
    "ds zero2 dp2": {"dp": 2, "backend": "deepspeed", "zero": 2},
    "dp4 (FSDP2)": {"dp": 4},
    "dp2 x tp2": {"dp": 2, "tp": 2},
    "pp2 x dp2": {"pp": 2, "dp": 2, "microbatches": 2},
    "pp2 x dp2 x tp2": {"pp": 2, "dp": 2, "tp": 2, "microbatches": 2},
}


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from tunelab.core.config import CellConfig
    from tunelab.train import parallel as par

    cell = CellConfig.model_validate({
        "model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"}, "parallel": json.loads(args.layout),
        "train": {"batch_size": args.batch, "grad_accum": 1}})
    layout = par.setup(cell.parallel)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 8 * 8,
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(layout.device)
    stepper = par.prepare(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4), cell, layout)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4096, (args.batch, args.seq), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    n = args.batch * (args.seq - 1)
    stepper.train_step([batch], n)  # warm-up: allocations, pipeline shape inference
    sync = torch.cuda.synchronize if layout.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        stepper.train_step([batch], n)
    sync()
    dt = time.perf_counter() - t0
    if layout.is_main:
        Path(args.out).write_text(json.dumps({"tokens_per_s": args.steps * args.batch * args.seq / dt,
                                              "step_s": dt / args.steps}))
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-procs", type=int, default=None, help="largest world size (default: GPUs, or 4 on CPU)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    import torch

    gpus = torch.cuda.device_count()
    limit = args.max_procs or (gpus if gpus else 4)
    device = f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else f"CPU, {os.cpu_count()} cores"
    print(f"device: {device}; Llama hidden {args.hidden}, {args.layers} layers, batch {args.batch} x "
          f"{args.seq} tokens, AdamW fp32, {args.steps} timed steps\n")
    print("| layout | processes | tokens/s | s/step |\n|---|---|---|---|")
    for name, layout in LAYOUTS.items():
        world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)
        if world > limit:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   __file__, "--worker", "--layout", json.dumps(layout), "--out", str(out),
                   *(f"--{k}={getattr(args, k)}" for k in ("steps", "hidden", "layers", "seq", "batch"))]
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if not out.is_file():
                print(f"| {name} | {world} | failed: {proc.stderr.strip().splitlines()[-1][:80]} | |")
                continue
            r = json.loads(out.read_text())
            print(f"| {name} | {world} | {r['tokens_per_s']:.0f} | {r['step_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
