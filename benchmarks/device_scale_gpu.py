"""Sharded initialisation on a GPU: the code paths a multi-GPU cell takes, on the one GPU a lent machine has.

    torchrun --standalone --nproc-per-node 1 benchmarks/device_scale_gpu.py MODEL_FOLDER

NCCL refuses two processes on one GPU, so this runs one process in a process group of one: the layout is
"distributed" (a DeviceMesh of size 1), so a cell would build its model the sharded way. For each way the
model is built (whole with loading.load, on the meta device then filled per shard on CUDA, under DeepSpeed's
zero.Init on CUDA), it trains 3 fp32 AdamW steps on fixed batches and prints the losses (they must agree),
the peak CUDA memory allocated during load and training, and exp memory's prediction for one process.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def batches(n: int = 3):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        ids = torch.randint(2, 1000, (4, 64), generator=g)
        yield [{"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}]


def run(folder: str, how: str) -> tuple[list[float], float]:
    from tunelab.core.config import CellConfig
    from tunelab.machine import runtime
    from tunelab.models import loading
    from tunelab.train import optim
    from tunelab.train import parallel as par

    backend = "deepspeed" if how == "zero3" else "native"
    cell = CellConfig.model_validate({
        "model": {"name": folder, "dtype": "float32", "attn": "sdpa"}, "data": {"recipe": "arithmetic"},
        "parallel": {"backend": backend, "zero": 3}, "train": {"batch_size": 4, "device": "cuda"},
        "optim": {"lr": 1e-4}})
    layout = par.setup(cell.parallel)
    rt = runtime.resolve(cell, layout)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    weights = None
    if how == "whole":
        model, _ = loading.load(cell.model, rt)
    elif how == "meta":
        model, weights = par.with_adapters(loading.empty(cell.model, rt.dtype, rt.attn), lambda m: m,
                                           loading.Weights(loading.folder(cell.model)))
    else:
        model = par.load_partitioned(cell.model, rt, cell)
    stepper = par.prepare(model, lambda ps: optim.build(ps, cell.optim, max_grad_norm=1.0), cell, layout,
                          weights=weights)
    losses = []
    for step in batches():
        n = sum(int((b["labels"][:, 1:] != -100).sum()) for b in step)
        losses.append(stepper.train_step(step, n)[0])
    peak = torch.cuda.max_memory_allocated() / 2**20
    del stepper, model
    return losses, peak


def main() -> None:
    from tunelab.train.parallel.memory import Setup, estimate, load_shape

    folder = sys.argv[1]
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    shape = load_shape(folder)
    predicted = estimate(shape, Setup(optim="adamw", dtype="float32", seq=64, batch=4)).peak / 2**20
    print(f"model {shape.total() / 1e6:.1f}M parameters; exp memory predicts {predicted:.0f} MiB for one process")
    results = {}
    for how in ("whole", "meta", "zero3"):
        try:
            results[how] = run(folder, how)
        except Exception as e:  # noqa: BLE001 - reported, the other ways still run
            print(f"{how}: FAILED {type(e).__name__}: {e}")
            continue
        losses, peak = results[how]
        print(f"{how:6s} losses {' '.join(f'{x:.6f}' for x in losses)}  peak allocated {peak:.0f} MiB "
              f"({peak / predicted - 1:+.1%} vs predicted)")
    if "whole" in results:
        ref = results["whole"][0]
        for how, (losses, _) in results.items():
            print(f"{how}: max |loss - whole| = {max(abs(a - b) for a, b in zip(losses, ref)):.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
