"""train.precision bf16 against fp32 on this CPU: tokens/s and the loss difference over the quickstart cell.

    python benchmarks/cpu_bf16.py [--steps 50] [--model smollm2-135m-instruct] [--out FILE]

The quickstart's AdamW full-parameter cell (SmolLM2-135M-Instruct, the arithmetic recipe, batch 4, max_length
256) trained twice in this process from the same seed: bf16 autocast (weights stay fp32) and plain fp32.
Printed: tokens/s of each (steps after the first 3), the largest and the final relative loss difference, and
whether this CPU has native bf16 instructions (avx512_bf16 / amx_bf16 in /proc/cpuinfo). tunelab's `auto`
picks bf16 on a CPU only if this measurement says it is faster with losses within 2% (docs/training.md).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


def train(precision: str, args) -> tuple[list[float], list[int], dict[int, float]]:
    """(loss per step, tokens per step, the time each step ended)."""
    from transformers import set_seed

    from tunelab import train
    from tunelab.core.events import Step
    from tunelab.core.paths import cache_dir
    from tunelab.data.build import build
    from tunelab.models import loading
    from tunelab.plan import cell_config

    cfg = cell_config({"model": {"name": args.model, "dtype": "float32"},
                       "data": {"recipe": "arithmetic", "max_length": 256},
                       "optim": {"name": "adamw", "lr": 2e-5},
                       "train": {"steps": args.steps, "batch_size": 4, "warmup_steps": 2, "precision": precision,
                                 "save_final": False, "device": "cpu"},
                       "eval": {"tasks": []}, "tracking": {"wandb": False}})
    set_seed(0)
    model, tok = loading.load(cfg.model, "cpu")
    ds = build(cfg.data, tok, cache_dir())
    stamps: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        train.run(model, tok, ds, cfg, Path(tmp),
                  lambda ev: stamps.__setitem__(ev.step, time.perf_counter()) if isinstance(ev, Step) else None)
        rows = [json.loads(x) for x in (Path(tmp) / "train" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows], [r["tokens"] for r in rows], stamps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    import torch

    flags = cpu_flags()
    native = sorted(flags & {"avx512_bf16", "amx_bf16"})
    result = {"model": args.model, "steps": args.steps, "threads": torch.get_num_threads(),
              "native_bf16": native or None, "load_average_start": os.getloadavg()[0]}
    runs = {}
    for precision in ("fp32", "bf16"):
        losses, tokens, stamps = train(precision, args)
        t = sum(tokens[3:]) / (stamps[args.steps] - stamps[3])
        runs[precision] = {"losses": losses, "tokens_per_s": t}
        print(f"{precision}: {t:.1f} tokens/s, final loss {losses[-1]:.4f}", flush=True)
    rel = [abs(b - a) / abs(a) for a, b in zip(runs["fp32"]["losses"], runs["bf16"]["losses"])]
    result.update({p: {"tokens_per_s": round(r["tokens_per_s"], 1), "final_loss": r["losses"][-1]}
                   for p, r in runs.items()})
    result.update({"speedup_bf16": round(runs["bf16"]["tokens_per_s"] / runs["fp32"]["tokens_per_s"], 3),
                   "max_rel_loss_diff": round(max(rel), 4), "final_rel_loss_diff": round(rel[-1], 4),
                   "load_average_end": os.getloadavg()[0]})
    verdict = result["speedup_bf16"] > 1 and result["max_rel_loss_diff"] <= 0.02
    result["bf16_worth_it"] = verdict
    print(f"bf16 / fp32 tokens/s: {result['speedup_bf16']:.2f}x; loss difference max "
          f"{result['max_rel_loss_diff']:.2%}, final {result['final_rel_loss_diff']:.2%}; native bf16 instructions: "
          f"{native or 'none'}; "
          f"bf16 faster with losses within 2%: {'yes' if verdict else 'no'}")
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
