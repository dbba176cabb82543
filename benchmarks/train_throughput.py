"""Training throughput, tunelab's loop vs transformers' Trainer: same model, batches, precision, optimizer.

    python benchmarks/train_throughput.py [--steps 20] [--warmup 3] [--batch 4] [--max-length 256]
                                          [--model NAME] [--device auto] [--out FILE]

Both train full-parameter AdamW on the same batches: the rows of the tokenized dataset in tunelab's
shuffled order, fetched and padded to the longest row of each batch by the same collate function while
training (Trainer reads them in that order from an iterable dataset). Both log every step and are timed
from the end of the warmup steps to the end of the last step. Tokens are the non-padding tokens of the
timed batches (identical for both). On CUDA both run fp32 weights with bf16 autocast (Trainer's
bf16=True); on CPU both run fp32.

With --pack, tunelab trains on the same recipe packed into rows of --max-length tokens (data.pack: true:
no padding, no attention across examples), with as many rows per step as keep the tokens per step about
equal to the padded batches'; Trainer keeps the padded batches. Tokens are then each side's own
non-padding tokens, so the ratio is useful tokens per second.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path


def default_model() -> str:
    from tunelab import models

    cached = models.cache_dir() / "models" / "smollm2-135m-instruct"
    return "smollm2-135m-instruct" if cached.is_dir() else "tiny-random-llama"


def make_cfg(args, device_type: str, pack: bool = False, batch: int | None = None):
    from tunelab.config import CellConfig

    return CellConfig.model_validate({
        "model": {"name": args.model, "dtype": "float32", "attn": "sdpa"},
        "data": {"recipe": "arithmetic", "max_length": args.max_length, "pack": pack},
        "optim": {"name": "adamw", "lr": 2e-5},
        "train": {"steps": args.warmup + args.steps, "batch_size": batch or args.batch, "schedule": "constant",
                  "device": device_type, "precision": "bf16" if device_type == "cuda" else "fp32",
                  "save_final": False},
        "eval": {"tasks": []}, "tracking": {"wandb": False},
    })


def timed(stamps: dict[int, tuple[float, float]], tokens: list[int], warmup: int) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of this process) over the steps after warmup.
    CPU time is the steadier figure on a shared machine; wall time is what a user waits."""
    last = max(stamps)
    n = sum(tokens[warmup:last])
    return n / (stamps[last][0] - stamps[warmup][0]), n / (stamps[last][1] - stamps[warmup][1])


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def run_tunelab(cfg, device, ds, tok, tokens, warmup) -> tuple[float, float]:
    from tunelab import models, train

    model, _ = models.load(cfg.model, device)
    stamps: dict[int, tuple[float, float]] = {}

    def emit(**ev):
        if ev.get("stage") == "train":
            _sync(device)
            stamps[ev["step"]] = _now()

    with tempfile.TemporaryDirectory() as tmp:
        train.run(model, tok, ds, cfg, Path(tmp), emit)
    return timed(stamps, tokens, warmup)


def run_trainer(cfg, device, ds, order, pad_id, tokens, warmup) -> tuple[float, float]:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from tunelab import models
    from tunelab.train.data import collate

    model, _ = models.load(cfg.model, device)
    stamps: dict[int, tuple[float, float]] = {}
    rows = ds.with_format(None)

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            _sync(device)
            stamps[state.global_step] = _now()

    class Rows(torch.utils.data.IterableDataset):
        def __iter__(self):
            return (rows[i] for i in order)

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, max_steps=cfg.train.steps, per_device_train_batch_size=cfg.train.batch_size,
            learning_rate=cfg.optim.lr, lr_scheduler_type="constant", optim="adamw_torch",
            max_grad_norm=cfg.train.max_grad_norm, logging_steps=1, save_strategy="no", report_to="none",
            use_cpu=device.type == "cpu", bf16=cfg.train.precision == "bf16", dataloader_num_workers=0,
            disable_tqdm=True,
        )
        Trainer(model=model, args=args, train_dataset=Rows(), data_collator=collate(pad_id),
                callbacks=[Stamp()]).train()
    return timed(stamps, tokens, warmup)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--model", default=None, help="default: smollm2-135m-instruct when cached, else tiny")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--repeats", type=int, default=1, help="runs of each, alternated; medians reported")
    p.add_argument("--out", type=Path, default=None, help="also write the figures as JSON")
    p.add_argument("--pack", action="store_true", help="tunelab trains on packed rows (Trainer stays padded)")
    args = p.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")

    import torch

    from tunelab import models
    from tunelab.data.build import build
    from tunelab.train.data import batch_tokens, loader
    from tunelab.train.loop import BatchStream

    args.model = args.model or default_model()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          args.device if args.device != "auto" else "cpu")
    cfg = make_cfg(args, device.type)
    _, tok = models.load(cfg.model, "cpu")
    ds = build(cfg.data, tok, models.cache_dir())
    # tunelab's row order: the same sampler and generator draws as its loader, over row indices.
    indices = BatchStream(torch.utils.data.DataLoader(range(len(ds["train"])), batch_size=args.batch, shuffle=True,
                                                      generator=torch.Generator().manual_seed(cfg.train.seed)))
    order = [int(i) for _ in range(cfg.train.steps) for i in next(indices)]
    stream = BatchStream(loader(ds["train"], args.batch, tok.pad_token_id, shuffle=True, seed=cfg.train.seed))
    batches = [next(stream) for _ in range(cfg.train.steps)]
    tokens = [int(b["attention_mask"].sum()) for b in batches]
    padded = sum(b["attention_mask"].numel() for b in batches)

    tl_cfg, tl_ds, tl_tokens = cfg, ds, tokens
    if args.pack:  # rows of max_length tokens, as many per step as carry about the padded batch's tokens
        rows = max(1, round(sum(tokens) / len(tokens) / args.max_length))
        tl_cfg = make_cfg(args, device.type, pack=True, batch=rows)
        tl_ds = build(tl_cfg.data, tok, models.cache_dir())
        packed = BatchStream(loader(tl_ds["train"], rows, tok.pad_token_id, shuffle=True, seed=cfg.train.seed))
        tl_tokens = [batch_tokens(next(packed)) for _ in range(cfg.train.steps)]

    runs: dict[str, list[tuple[float, float]]] = {"tunelab": [], "Trainer": []}
    for _ in range(args.repeats):  # alternated, so a change in machine load hits both alike
        runs["Trainer"].append(run_trainer(cfg, device, ds["train"], order, tok.pad_token_id, tokens, args.warmup))
        runs["tunelab"].append(run_tunelab(tl_cfg, device, tl_ds, tok, tl_tokens, args.warmup))
    wall = {k: statistics.median(w for w, _ in v) for k, v in runs.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
    result = {
        "model": args.model, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "precision": cfg.train.precision, "batch": args.batch, "max_length": args.max_length,
        "steps_timed": args.steps, "repeats": args.repeats, "padding_share": round(1 - sum(tokens) / padded, 3),
        "tunelab_packed": args.pack, "tunelab_rows_per_step": tl_cfg.train.batch_size,
        "tokens_per_s": {k: round(v, 1) for k, v in wall.items()},
        "tokens_per_cpu_s": {k: round(v, 1) for k, v in cpu.items()},
        "ratio": round(wall["tunelab"] / wall["Trainer"], 3),
        "ratio_cpu_time": round(cpu["tunelab"] / cpu["Trainer"], 3),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
    }
    print(f"{'':10} {'tokens/s':>10} {'tokens/CPU-s':>13}")
    for k in ("tunelab", "Trainer"):
        print(f"{k:10} {wall[k]:10.1f} {cpu[k]:13.1f}")
    print(f"ratio tunelab/Trainer: {result['ratio']:.3f} wall, {result['ratio_cpu_time']:.3f} CPU time  "
          f"({result['model']}, {result['device']}, {result['precision']}, batch {args.batch}, "
          f"padding {result['padding_share']:.0%} of positions, median of {args.repeats})")
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
