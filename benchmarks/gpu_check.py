"""GPU check: train a quickstart-family cell (SmolLM2-135M) with tunelab's defaults on this machine's GPU
(bf16, flash-attn 2 when installed, else SDPA) and print tokens/s, MFU and peak memory.

    python benchmarks/gpu_check.py --steps 20 --out FILE

Uses the smollm2-135m-instruct weights when they are already cached (no download is tried); otherwise a
randomly initialized model of the same architecture, with the tiny test tokenizer (throughput and memory
depend on the shapes, not on the weights). Without CUDA it runs a short CPU pass and says which GPU-only
parts (bf16 default, flash-attn, MFU, CUDA peak memory) it skips. Every figure printed is measured.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# SmolLM2-135M's architecture (its config.json), for when the weights are not at hand.
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                     tie_word_embeddings=True, vocab_size=49152, rms_norm_eps=1e-5)


def model_source(tmp: Path) -> tuple[str, str]:
    """(model name for the cell, what it is)."""
    from tunelab.models import loading

    cached = loading.cache_dir() / "models" / "smollm2-135m-instruct"
    if cached.is_dir():
        return "smollm2-135m-instruct", "SmolLM2-135M-Instruct weights (tunelab cache)"
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(loading.resolve("tiny-random-llama"))
    config = LlamaConfig(**SMOLLM2_SHAPE, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=None)
    torch.manual_seed(0)
    folder = tmp / "smollm2-shape"
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder), "SmolLM2-135M architecture, random weights (weights not cached here)"


def train_cell(name: str, run_dir: Path, steps: int, batch: int, max_length: int, attn: str, device: str) -> dict:
    """The cell's stages, in process: loading.load -> data.build -> peft.apply -> train.run."""
    from transformers import set_seed

    from tunelab import train
    from tunelab.core.config import CellConfig
    from tunelab.data.build import build
    from tunelab.models import loading
    from tunelab.train import peft

    cfg = CellConfig.model_validate({
        "model": {"name": name, "attn": attn},  # dtype auto: bf16 on CUDA
        "data": {"recipe": "arithmetic", "max_length": max_length},
        "optim": {"name": "adamw", "lr": 2e-5},
        "train": {"steps": steps, "batch_size": batch, "device": device, "save_final": False},
        "eval": {"tasks": []}, "tracking": {"wandb": False},
    })
    set_seed(0)
    model, tok = loading.load(cfg.model, device)
    ds = build(cfg.data, tok, loading.cache_dir())
    model = peft.apply(model, cfg.peft)
    result = train.run(model, tok, ds, cfg, run_dir)
    rows = [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    timed = rows[min(3, len(rows) - 1):]  # the first steps include kernel selection and allocator growth
    mfus = [r["mfu"] for r in timed if r["mfu"] is not None]
    return {
        "attn": model.config._attn_implementation, "weights_dtype": str(next(model.parameters()).dtype),
        "precision": result.precision, "steps": len(rows), "steps_timed": len(timed),
        "tokens_per_s": round(sum(r["tokens"] for r in timed) / sum(r["step_s"] for r in timed), 1),
        "mfu": round(statistics.median(mfus), 4) if mfus else None,
        "peak_mem_mb": round(result.peak_mem_mb, 1), "peak_mem_kind": result.peak_mem_kind,
        "final_loss": round(result.final_loss, 4), "params": result.total_params,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here too")
    args = p.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")

    import torch
    import transformers

    from tunelab.train.metrics import peak_flops

    cuda = torch.cuda.is_available()
    has_flash = importlib.util.find_spec("flash_attn") is not None
    notes = []
    if not cuda:
        notes.append("no CUDA device: skipping the GPU-only parts (bf16 default, flash-attn, MFU, CUDA peak "
                     "memory); a short fp32 CPU pass checks that the path runs")
        args.steps, args.batch, args.max_length = min(args.steps, 4), min(args.batch, 2), min(args.max_length, 128)
    elif not has_flash:
        notes.append("flash-attn is not installed: attn auto resolves to sdpa")
    device = torch.device("cuda" if cuda else "cpu")
    report = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "peak_bf16_flops": peak_flops(device), "flash_attn_installed": has_flash,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "cuda": torch.version.cuda},
        "batch": args.batch, "max_length": args.max_length, "notes": notes, "runs": {},
    }
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        name, report["model"] = model_source(Path(tmp))
        attns = ["auto"] + (["sdpa"] if cuda and has_flash else [])  # flash vs sdpa side by side
        for attn in attns:
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            run = train_cell(name, Path(tmp) / f"run-{attn}", args.steps, args.batch, args.max_length, attn,
                             device.type)
            run["wall_s"] = round(time.perf_counter() - t0, 1)
            report["runs"][attn] = run

    print(f"{report['model']} on {report['device']}, batch {args.batch} x up to {args.max_length} tokens")
    print(f"{'attn':20} {'weights':15} {'prec':5} {'tokens/s':>10} {'MFU':>7} {'peak MB':>9}")
    for run in report["runs"].values():
        mfu = f"{run['mfu']:.1%}" if run["mfu"] is not None else "n/a"
        print(f"{run['attn']:20} {run['weights_dtype']:15} {run['precision']:5} {run['tokens_per_s']:10.1f} "
              f"{mfu:>7} {run['peak_mem_mb']:9.1f}")
    print(json.dumps(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
