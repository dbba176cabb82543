"""Per-rank memory of a model built sharded, against one process and against `exp memory`'s prediction.

    python benchmarks/scale_memory.py --out /tmp/scale [--device cpu|cuda] [--tensors]

Builds the random Llama of tests/test_parallel_scale.py (100.7M parameters, fp32), runs its matrix with
`exp run` (one process, FSDP2 dp 4, DeepSpeed ZeRO-3 dp 4; on --device cuda only the one-process cell: NCCL
refuses two ranks on one GPU) and prints, per cell and rank, the peak during load and training, what the
load and training added to the process (net), the ratio to the one-process cell and exp memory's
prediction. On CPU the peak is RSS, measured with glibc's mmap threshold fixed at 128 KiB (see the test's
docstring); on CUDA torch.cuda.max_memory_allocated. --tensors also measures the sharded cells' tensor
memory with torch's MemTracker (the quantity the memory model counts), in a torchrun launch of 4 CPU ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from test_parallel_scale import MATRIX, SHAPE, build_model  # noqa: E402

MIB = 2**20
CELLS = {"native-dp1": (1, "native"), "native-dp4": (4, "native"), "deepspeed-dp4": (4, "deepspeed")}


def predicted(dp: int, backend: str, dtype: str) -> float:
    from tunelab.train.parallel.memory import Setup, Shape, estimate

    shape = Shape(vocab=SHAPE["vocab_size"], hidden=SHAPE["hidden_size"], inter=SHAPE["intermediate_size"],
                  layers=SHAPE["num_hidden_layers"], heads=SHAPE["num_attention_heads"],
                  kv_heads=SHAPE["num_key_value_heads"], head_dim=64, tied=False)
    return estimate(shape, Setup(optim="adamw", dtype=dtype, dp=dp, backend=backend, seq=64, batch=4,
                                 activation_checkpointing=True)).peak / MIB


def run_matrix(out: Path, device: str) -> Path:
    if not (out / "model").is_dir():
        build_model(out / "model")
    text = MATRIX.format(model=out / "model")
    if device == "cuda":  # fp32 as on CPU, so that the prediction is the same
        text = text.replace(f"name: {out / 'model'}}}", f"name: {out / 'model'}, dtype: float32}}")
        text = text.replace("save_final: false}", "save_final: false, device: cuda}").replace(
            "parallel.dp: [1, 4]", "parallel.dp: [1]").replace("parallel.backend: [native, deepspeed]",
                                                               "parallel.backend: [native]")
        text = text.split("exclude:")[0]
    (out / "scale.yaml").write_text(text)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    subprocess.run([sys.executable, "-c", "from tunelab.cli import main; main()", "run", str(out / "scale.yaml"),
                    "--runs-dir", str(out / "runs")], env=env, check=True)
    return out / "runs" / "scale"


def report(mdir: Path, device: str) -> None:
    dtype = "float32"
    rows, one = [], None
    for slug, (dp, backend) in CELLS.items():
        found = list(mdir.glob(f"{slug}-*/train/memory.json"))
        if not found:
            continue
        m = json.loads(found[0].read_text())
        net = [p - b for p, b in zip(m["peak_mb"], m["rss_before_load_mb"])] if m["kind"] == "peak_rss" \
            else m["peak_mb"]
        losses = [json.loads(line)["loss"] for line in (found[0].parent / "metrics.jsonl").read_text().splitlines()]
        one = one or (max(m["peak_mb"]), max(net))
        rows.append((slug, m["kind"], m["peak_mb"], net, predicted(dp, backend, dtype), losses))
    print(f"| cell | measured ({rows[0][1]}) per rank, MiB | added by load + training, MiB | "
          "share of one process (total / added) | exp memory predicts, MiB | prediction error | losses |")
    print("|---|---|---|---|---|---|---|")
    for slug, _, peaks, net, pred, losses in rows:
        share = f"{max(peaks) / one[0]:.2f} / {max(net) / one[1]:.2f}"
        print(f"| {slug} | {' '.join(f'{p:.0f}' for p in peaks)} | {' '.join(f'{n:.0f}' for n in net)} | {share} "
              f"| {pred:.0f} | {pred / max(net) - 1:+.1%} | {' '.join(f'{x:.6f}' for x in losses)} |")


TENSORS = r'''
import sys, torch, torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from tunelab.models import loading
from tunelab.machine import runtime
from tunelab.core.config import CellConfig
from tunelab.train import optim, parallel as par
backend, folder = sys.argv[1], sys.argv[2]
cell = CellConfig.model_validate({"model": {"name": folder}, "data": {"recipe": "arithmetic"},
    "parallel": {"dp": 4, "backend": backend}, "train": {"batch_size": 4, "gradient_checkpointing": True},
    "optim": {"lr": 1e-4}})
layout = par.setup(cell.parallel)
rt = runtime.resolve(cell, layout)
tracker = MemTracker()
with tracker:
    if backend == "deepspeed":
        model, weights = par.load_partitioned(cell.model, rt, cell), None
    else:
        model, weights = par.with_adapters(loading.empty(cell.model, rt.dtype, rt.attn), lambda m: m,
                                           loading.Weights(loading.folder(cell.model)))
    stepper = par.prepare(model, lambda ps: optim.build(ps, cell.optim, max_grad_norm=1.0), cell, layout,
                          weights=weights)
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        stepper.train_step([{"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}], 252)
        tracker.reset_mod_stats()
peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] / 2**20
out = [None] * dist.get_world_size()
dist.all_gather_object(out, peak)
if dist.get_rank() == 0:
    print("TENSORS", backend, " ".join(f"{p:.0f}" for p in out))
'''


def tensors(out: Path) -> None:
    script = out / "tensors.py"
    script.write_text(TENSORS)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for backend in ("native", "deepspeed"):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                               str(script), backend, str(out / "model")], check=False, env=env, capture_output=True,
                              text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("TENSORS")), proc.stderr[-2000:])
        print(f"{line}   (exp memory predicts {predicted(4, backend, 'float32'):.0f} MiB)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--tensors", action="store_true")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    report(run_matrix(a.out, a.device), a.device)
    if a.tensors:
        tensors(a.out)


if __name__ == "__main__":
    main()
