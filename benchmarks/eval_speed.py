"""MMLU (5-shot) with tunelab's engine vs lm-eval's CLI path, same model, same data, same prompts.

    python benchmarks/eval_speed.py [--model smollm2-135m-instruct] [--limit 7] [--batch-size 8]

tunelab: the model loaded once, `evals.run` with tunelab's task definitions (SharedPrefixLM: each
subject's 5-shot prefix runs once). lm-eval: what `lm_eval --model hf --tasks mmlu_*` does, a fresh
HFLM loaded from the model folder and lm-eval's built-in mmlu_* tasks, pointed at the same local files.
Data: the offline MMLU (`exp eval pull`, fetched here if missing). Prints examples/s, the ratio, and
both accuracies side by side.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def tunelab_run(model_name: str, data: Path, subjects: list[str], limit: int, batch_size: int,
                out: Path) -> tuple[float, float, int]:
    from tunelab import evals, models
    from tunelab.config import EvalCfg, ModelCfg

    t0 = time.perf_counter()
    model, tok = models.load(ModelCfg(name=model_name, dtype="float32", attn="sdpa"))
    cfg = EvalCfg(tasks=["mmlu"], limit=limit, data_dir=str(data), batch_size=batch_size, subtasks={"mmlu": subjects})
    r = evals.run(model, tok, cfg, evals.Context(out_dir=out))["tasks"]["mmlu"]
    return time.perf_counter() - t0, r["value"], r["n"]


def lm_eval_run(model_name: str, data: Path, subjects: list[str], limit: int,
                batch_size: int) -> tuple[float, float, int]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from tunelab import models
    from tunelab.evals import exemplars
    from tunelab.evals.sources import read_jsonl

    t0 = time.perf_counter()
    tasks = []
    for s in subjects:
        files = {split: str(data / "mmlu" / s / f"{split}.jsonl") for split in ("test", "dev")}
        shots = min(5, len(read_jsonl(Path(files["dev"]))))  # first_n refuses more shots than the pool
        tasks.append({"task": f"mmlu_{s}", "num_fewshot": shots, "dataset_path": "json", "dataset_name": None,
                      "dataset_kwargs": {"data_files": files}})
    # Only lm-eval's mmlu folder is indexed; the CLI indexes every built-in task first (~18 s here).
    tm = TaskManager(include_defaults=False, include_path=str(exemplars.lm_eval_tasks_dir() / "mmlu" / "default"))
    out = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": models.resolve(model_name), "dtype": "float32", "device": "cpu"},
        tasks=[{"group": "mmlu_speed", "task": tasks}], task_manager=tm, limit=limit, batch_size=batch_size)
    n = sum(v["effective"] for v in out["n-samples"].values())
    right = sum(out["results"][f"mmlu_{s}"]["acc,none"] * out["n-samples"][f"mmlu_{s}"]["effective"]
                for s in subjects)
    return time.perf_counter() - t0, right / n, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--limit", type=int, default=7, help="questions per subject")
    ap.add_argument("--subjects", type=int, default=57, help="the first N subjects (alphabetical)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("/tmp/tunelab-eval-speed"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from tunelab.evals.pull import pull_mmlu
    from tunelab.evals.sources import cache_root

    data = cache_root()
    if not (data / "mmlu" / "anatomy" / "test.jsonl").is_file():
        pull_mmlu(data)
    import torch

    from tunelab.evals.exemplars import mmlu_subjects

    subjects = mmlu_subjects()[: args.subjects]
    print(f"model {args.model}, MMLU 5-shot, {len(subjects)} subjects x {args.limit} questions, "
          f"batch {args.batch_size}, {torch.get_num_threads()} threads", flush=True)
    t_ours, acc_ours, n_ours = tunelab_run(args.model, data, subjects, args.limit, args.batch_size, args.out)
    t_ref, acc_ref, n_ref = lm_eval_run(args.model, data, subjects, args.limit, args.batch_size)
    print(f"{'':10s} {'questions':>9s} {'seconds':>8s} {'q/s':>6s} {'accuracy':>9s}")
    print(f"{'tunelab':10s} {n_ours:9d} {t_ours:8.1f} {n_ours / t_ours:6.2f} {acc_ours:9.6f}")
    print(f"{'lm-eval':10s} {n_ref:9d} {t_ref:8.1f} {n_ref / t_ref:6.2f} {acc_ref:9.6f}")
    print(f"speed-up {t_ref / t_ours:.2f}x; accuracy difference {abs(acc_ours - acc_ref):.2e}")


if __name__ == "__main__":
    main()
