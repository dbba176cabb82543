"""train.run(model, tokenizer, datasets, cfg, run_dir) -> TrainResult: the training loop.

Per optimizer step: `grad_accum` micro-batches, loss = sum of token losses / label tokens of the whole
step (transformers' Trainer normalization), clipping, optimizer and scheduler step, one metrics.jsonl
record. Every `save_every` steps a checkpoint; a run that finds one resumes from it exactly.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tunelab.store import append_jsonl, read_jsonl, write_json, write_text
from tunelab.train import checkpoint, optim
from tunelab.train.data import batch_tokens, label_tokens, loader
from tunelab.train.loss import causal_lm_loss
from tunelab.train.metrics import mfu, peak_flops, peak_memory_mb
from tunelab.train.optimizers.tied import prepare_for_fused

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
    precision: str
    resumed_from: int | None
    world_size: int = 1
    model: object = field(default=None, repr=False)  # the trained model with full weights (main process)

    def summary(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "model"}


def lr_lambda(schedule: str, warmup: int, total: int) -> Callable[[int], float]:
    def fn(step: int) -> float:  # step = optimizer steps taken so far
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return {"constant": 1.0, "linear": 1.0 - progress,
                "cosine": 0.5 * (1.0 + math.cos(math.pi * progress))}[schedule]

    return fn


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision != "auto":
        return precision
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def autocast(precision: str, device: torch.device):
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class BatchStream:
    """Micro-batches epoch after epoch, with a position a checkpoint can restore exactly: the state of
    the loader's shuffling generator when the current epoch began, and how many batches it gave since."""

    def __init__(self, dl):
        self.dl, self.epoch, self.taken = dl, 0, 0
        self._begin_epoch(None)

    def _begin_epoch(self, generator_state) -> None:
        g = self.dl.generator
        if g is not None and generator_state is not None:
            g.set_state(generator_state)
        self._epoch_start = g.get_state() if g is not None else None
        self._it = iter(self.dl)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        try:
            batch = next(self._it)
        except StopIteration:
            self.epoch, self.taken = self.epoch + 1, 0
            self._begin_epoch(None)
            batch = next(self._it)
        self.taken += 1
        return batch

    def state(self) -> dict:
        return {"epoch": self.epoch, "taken": self.taken, "generator": self._epoch_start}

    def restore(self, state: dict) -> None:
        self._begin_epoch(state["generator"])
        for _ in range(state["taken"]):  # replays at most one epoch; batches are rebuilt, not trained on
            next(self._it)
        self.epoch, self.taken = state["epoch"], state["taken"]


def _forward_loss(model, batch: dict, n_items: int, device) -> torch.Tensor:
    """Sum of token losses / tokens in the whole accumulated step, as transformers' Trainer does; the output
    head runs only at positions that carry a label (train/loss.py)."""
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    return causal_lm_loss(model, batch, n_items)


@torch.no_grad()
def validation_loss(model, ds, pad_id: int, batch_size: int, max_batches: int | None = None,
                    precision: str = "fp32") -> float:
    """Token-weighted mean loss over the validation set."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    attn = getattr(model.config, "_attn_implementation", "sdpa")
    for i, batch in enumerate(loader(ds, batch_size, pad_id, shuffle=False, attn=attn)):
        if max_batches is not None and i >= max_batches:
            break
        n = label_tokens(batch)
        with autocast(precision, device):
            total += float(_forward_loss(model, batch, n, device)) * n
        count += n
    model.train(was_training)
    return total / max(count, 1)


def stepper_validation_loss(stepper, ds, pad_id: int, batch_size: int, max_batches: int | None = None) -> float:
    """The same token-weighted mean, computed by a parallel engine (the same value on every rank)."""
    total, count = 0.0, 0
    for i, batch in enumerate(loader(ds, batch_size, pad_id, shuffle=False)):
        if max_batches is not None and i >= max_batches:
            break
        loss, n = stepper.eval_loss(batch)
        total, count = total + loss, count + n
    return total / max(count, 1)


def enable_gradient_checkpointing(model) -> None:
    # Non-reentrant checkpointing works when the inputs need no grad (frozen embeddings under PEFT).
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name for it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def _train_step(model, opt, params, micro: list[dict], n_items: int, device, precision: str,
                max_grad_norm: float | None) -> tuple[float, float | None]:
    if hasattr(opt, "fused_step"):
        # Optimizers that update inside backward (LOMO, AdaLomo) run forward/backward themselves:
        # no full set of gradients ever exists, so there is nothing to clip or step here.
        def closure(b=micro[0]):
            with autocast(precision, device):
                return _forward_loss(model, b, n_items, device)

        loss, norm = opt.fused_step(closure)
        return float(loss), None if norm is None else float(norm)
    loss = torch.zeros((), device=device)
    for b in micro:
        with autocast(precision, device):
            step_loss = _forward_loss(model, b, n_items, device)
        step_loss.backward()
        loss += step_loss.detach()
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or float("inf"))
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss_f, norm_f = torch.stack([loss.float(), norm.float().to(device)]).tolist()  # one device sync
    return loss_f, norm_f


def _truncate_metrics(path: Path, last_step: int) -> None:
    """A resumed run rewrites the steps after its checkpoint: drop them so no step appears twice."""
    kept = [r for r in read_jsonl(path) if r.get("step", 0) <= last_step]
    write_text(path, "".join(json.dumps(r, default=str) + "\n" for r in kept))


def _uses_engine(cfg, layout) -> bool:
    """Multi-process layouts and DeepSpeed go through a parallel engine's Stepper; one plain process
    keeps the loop's own step (bf16 autocast, in-backward optimizers, Sophia's Hessian refresh)."""
    return layout is not None and (layout.distributed or cfg.parallel.backend != "native")


def run(model, tokenizer, datasets, cfg, run_dir: Path, emit: Emit = lambda **_: None,
        layout=None) -> TrainResult:
    """Every process of a layout calls this with the same model and data; only the main one writes files."""
    t = cfg.train
    torch.manual_seed(t.seed)
    device = next(model.parameters()).device
    precision = resolve_precision(t.precision, device)
    main = layout is None or layout.is_main
    if t.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    params = [p for p in model.parameters() if p.requires_grad]
    n_total = sum(p.numel() for p in model.parameters())
    stepper = None
    if _uses_engine(cfg, layout):
        from tunelab.train import parallel

        stepper = parallel.prepare(model, lambda ps: optim.build(ps, cfg.optim, max_grad_norm=t.max_grad_norm),
                                   cfg, layout)
        # Engines run the model in its own dtype (no autocast): report what the weights are.
        opt = stepper.optimizer
        precision = "bf16" if next(model.parameters()).dtype == torch.bfloat16 else "fp32"
    else:
        # Names let Muon tell embeddings from hidden matrices; LOMO/AdaLomo clip inside backward.
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        opt = optim.build(named, cfg.optim, max_grad_norm=t.max_grad_norm)
        if optim.spec(cfg.optim.name).fused:  # one gradient buffer for a tied embedding (optimizers/tied.py)
            prepare_for_fused(model, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(t.schedule, t.warmup_steps, t.steps))
    attn = getattr(model.config, "_attn_implementation", "sdpa")
    stream = BatchStream(loader(datasets["train"], t.batch_size, tokenizer.pad_token_id, shuffle=True,
                                seed=t.seed, attn=attn))
    metrics_path = run_dir / "train" / "metrics.jsonl"
    if main:
        metrics_path.parent.mkdir(parents=True, exist_ok=True)
    peak = peak_flops(device)

    def val_loss() -> float:
        args = (datasets["validation"], tokenizer.pad_token_id, cfg.eval.batch_size, cfg.eval.val_batches)
        return stepper_validation_loss(stepper, *args) if stepper else validation_loss(model, *args, precision)

    st = {"tokens_total": 0, "seconds": 0.0, "loss": float("nan"), "val_loss": None}
    start_step, resumed_from = 1, None
    ckpt = checkpoint.latest(run_dir) if t.resume else None
    if ckpt is not None:
        saved = checkpoint.load(ckpt, model=None if stepper else model, opt=None if stepper else opt, sched=sched)
        if stepper:
            stepper.load(ckpt / "engine")
        stream.restore(saved["data"])
        st.update(saved["loop"])
        checkpoint.set_rng_state(saved["rng"])  # last: nothing may draw from the RNGs after this
        resumed_from = start_step = saved["step"]
        start_step += 1
        if main:
            _truncate_metrics(metrics_path, saved["step"])
        emit(stage="resume", step=saved["step"], checkpoint=ckpt.name)
    elif main:
        metrics_path.unlink(missing_ok=True)

    model.train()
    for step in range(start_step, t.steps + 1):
        t0 = time.perf_counter()
        micro = [next(stream) for _ in range(t.grad_accum)]
        n_items = sum(label_tokens(b) for b in micro)
        tokens = sum(batch_tokens(b) for b in micro)
        lr = sched.get_last_lr()[0]
        if stepper:
            loss, norm = stepper.train_step(micro, n_items)
        else:
            loss, norm = _train_step(model, opt, params, micro, n_items, device, precision, t.max_grad_norm)
        if hasattr(opt, "after_step") and not stepper:  # e.g. Sophia refreshes its Hessian estimate
            opt.after_step(step=step, model=model, batch={k: v.to(device) for k, v in micro[-1].items()})
        sched.step()
        dt = time.perf_counter() - t0
        st["tokens_total"] += tokens
        st["seconds"] += dt
        st["loss"] = loss
        mem, _ = peak_memory_mb(device)
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens": tokens,
                  "tokens_per_s": tokens / dt, "step_s": dt, "peak_mem_mb": mem,
                  "mfu": mfu(n_total, tokens / dt, peak)}
        if t.eval_every and step % t.eval_every == 0 and len(datasets["validation"]):
            st["val_loss"] = record["val_loss"] = val_loss()
        if main and (step % t.log_every == 0 or step == t.steps or "val_loss" in record):
            append_jsonl(metrics_path, record)
        emit(stage="train", step=step, total=t.steps, loss=loss, metrics=record)
        if t.save_every and (step % t.save_every == 0 or step == t.steps):
            state = {"data": stream.state(), "loop": dict(st)}
            if stepper:
                checkpoint.save_engine(run_dir, step, stepper=stepper, sched=sched, loop_state=state,
                                       keep=t.keep_checkpoints, main=main)
            else:
                checkpoint.save(run_dir, step, model=model, opt=opt, sched=sched, keep=t.keep_checkpoints,
                                loop_state=state)

    val = None
    if "val_loss" in cfg.eval.tasks and len(datasets["validation"]):
        emit(stage="eval", task="val_loss")
        val = val_loss()
    mem, kind = peak_memory_mb(device)
    result = TrainResult(
        steps=t.steps, final_loss=st["loss"], val_loss=val,
        tokens_per_s=st["tokens_total"] / st["seconds"] if st["seconds"] else 0.0,
        peak_mem_mb=mem, peak_mem_kind=kind, train_seconds=st["seconds"],
        trainable_params=sum(p.numel() for p in params), total_params=n_total,
        precision=precision, resumed_from=resumed_from, world_size=layout.pp * layout.dp * layout.tp if layout else 1,
        model=stepper.unwrap() if stepper else model,  # every rank takes part in gathering the weights
    )
    if main:
        write_json(run_dir / "train" / "summary.json", result.summary())
        if t.save_final:
            result.model.save_pretrained(run_dir / "final")
            tokenizer.save_pretrained(run_dir / "final")
    return result
