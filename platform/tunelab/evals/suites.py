"""Evaluation suites: YAML files in evals/ whose keys are defaults for a cell's `eval` section."""

from __future__ import annotations

from tunelab import paths
from tunelab.errors import load_yaml

DOC_KEYS = {"description"}  # keys a suite file may carry that are not EvalCfg settings


def load_suite(name: str) -> dict:
    """The settings of suite `name` (a name in evals/ or a path). Raises ValueError, so that pydantic
    reports it at the key path `eval.suite` of the file being validated."""
    path = paths.find_named("evals", name)
    if path is None:
        raise ValueError(f"unknown suite {name!r}; suites in evals/: {', '.join(paths.available('evals'))}")
    data = load_yaml(path) or {}
    if not isinstance(data, dict):
        raise ValueError(f"suite file {path} must be a mapping of eval settings")
    from tunelab.config import EvalCfg

    bad = sorted(set(data) - set(EvalCfg.model_fields) - DOC_KEYS | ({"suite"} & set(data)))
    if bad:
        allowed = ", ".join(k for k in EvalCfg.model_fields if k != "suite")
        raise ValueError(f"suite file {path}: unknown key(s) {bad}; allowed: {allowed}")
    return {k: v for k, v in data.items() if k not in DOC_KEYS}
