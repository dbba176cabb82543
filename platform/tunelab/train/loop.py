"""train.run(model, tokenizer, datasets, cfg, run_dir) -> TrainResult: the training loop."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tunelab.store import append_jsonl, write_json
from tunelab.train import optim
from tunelab.train.data import forever, label_tokens, loader
from tunelab.train.metrics import peak_memory_mb

Emit = Callable[..., None]


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    val_loss: float | None
    tokens_per_s: float
    peak_mem_mb: float
    peak_mem_kind: str
    train_seconds: float
    trainable_params: int
    total_params: int


def lr_lambda(schedule: str, warmup: int, total: int) -> Callable[[int], float]:
    def fn(step: int) -> float:  # step = optimizer steps taken so far
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return {"constant": 1.0, "linear": 1.0 - progress,
                "cosine": 0.5 * (1.0 + math.cos(math.pi * progress))}[schedule]

    return fn


def _forward_loss(model, batch: dict, n_items: int, device) -> torch.Tensor:
    """Sum of token losses / tokens in the whole accumulated step, as transformers' Trainer does."""
    batch = {k: v.to(device) for k, v in batch.items()}
    return model(**batch, num_items_in_batch=torch.tensor(n_items, device=device)).loss


@torch.no_grad()
def validation_loss(model, ds, pad_id: int, batch_size: int, max_batches: int | None = None) -> float:
    """Token-weighted mean loss over the validation set."""
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i, batch in enumerate(loader(ds, batch_size, pad_id, shuffle=False)):
        if max_batches is not None and i >= max_batches:
            break
        n = label_tokens(batch)
        total += float(_forward_loss(model, batch, n, device)) * n
        count += n
    model.train()
    return total / max(count, 1)


def run(model, tokenizer, datasets, cfg, run_dir: Path, emit: Emit = lambda **_: None) -> TrainResult:
    t = cfg.train
    torch.manual_seed(t.seed)
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optim.build(params, cfg.optim)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(t.schedule, t.warmup_steps, t.steps))
    batches = forever(loader(datasets["train"], t.batch_size, tokenizer.pad_token_id, shuffle=True, seed=t.seed))
    metrics_path = run_dir / "train" / "metrics.jsonl"
    metrics_path.parent.mkdir(parents=True, exist_ok=True)
    metrics_path.unlink(missing_ok=True)

    model.train()
    start, tokens_total, loss = time.perf_counter(), 0, float("nan")
    for step in range(1, t.steps + 1):
        t0 = time.perf_counter()
        micro = [next(batches) for _ in range(t.grad_accum)]
        n_items = sum(label_tokens(b) for b in micro)
        loss, tokens = 0.0, 0
        for b in micro:
            step_loss = _forward_loss(model, b, n_items, device)
            step_loss.backward()
            loss += float(step_loss.detach())
            tokens += int(b["attention_mask"].sum())
        norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm or float("inf"))
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        tokens_total += tokens
        mem, _ = peak_memory_mb(device)
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": float(norm), "tokens": tokens,
                  "tokens_per_s": tokens / dt, "step_s": dt, "peak_mem_mb": mem}
        if step % t.log_every == 0 or step == t.steps:
            append_jsonl(metrics_path, record)
        emit(stage="train", step=step, total=t.steps, loss=loss)

    seconds = time.perf_counter() - start
    val = None
    if "val_loss" in cfg.eval.tasks and len(datasets["validation"]):
        emit(stage="eval", task="val_loss")
        val = validation_loss(model, datasets["validation"], tokenizer.pad_token_id, cfg.eval.batch_size,
                              cfg.eval.val_batches)
    mem, kind = peak_memory_mb(device)
    result = TrainResult(
        steps=t.steps, final_loss=loss, val_loss=val, tokens_per_s=tokens_total / seconds,
        peak_mem_mb=mem, peak_mem_kind=kind, train_seconds=seconds,
        trainable_params=sum(p.numel() for p in params),
        total_params=sum(p.numel() for p in model.parameters()),
    )
    write_json(run_dir / "train" / "summary.json", result.__dict__)
    if t.save_final:
        model.save_pretrained(run_dir / "final")
        tokenizer.save_pretrained(run_dir / "final")
    return result
