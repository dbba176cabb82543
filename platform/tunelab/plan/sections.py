"""Plan-time checks of single sections: names against the registries and content folders."""

from __future__ import annotations

from pathlib import Path

from tunelab.core import paths
from tunelab.core.config import CellConfig, DataCfg, EvalCfg, ModelCfg
from tunelab.core.errors import Problem, did_you_mean, load_yaml
from tunelab.core.paths import HUB_ID, looks_like_path  # noqa: F401 - the plan's other modules read them here
from tunelab.core.registries import MODELS, PEFT, TASKS, TEMPLATES
from tunelab.plan import lmtasks

SUITE_DOC_KEYS = {"description"}  # keys a suite file may carry that are not eval settings


def model_section(cfg: ModelCfg) -> list[Problem]:
    """An alias, a hub id or a path. Whether a path exists is a fact of the machine that runs the cell
    (runtime.check_host), not of the plan."""
    name = cfg.name
    if name in MODELS or looks_like_path(name) or HUB_ID.match(name):
        return []
    return [Problem(("model", "name"), f"{name!r} is not a catalog alias{did_you_mean(name, MODELS.names())}, a "
                    f"local folder path or a hub id (org/name); aliases: {', '.join(MODELS)}", name)]


def find_recipe(name: str):
    """The recipe file for a name in data_recipes/ or a path; ValueError naming the available ones."""
    path = paths.find_named("data_recipes", name)
    if path is None:
        known = paths.available("data_recipes")
        raise ValueError(f"no recipe {name!r}{did_you_mean(name, known)}: not a file and not in data_recipes/ "
                         f"(available: {', '.join(known)})")
    return path


def data_section(cfg: DataCfg) -> list[Problem]:
    out = []
    try:
        find_recipe(cfg.recipe)
    except ValueError as e:
        out.append(Problem(("data", "recipe"), str(e), cfg.recipe))
    if cfg.template is not None and cfg.template not in TEMPLATES:
        out.append(Problem(("data", "template"), TEMPLATES.unknown(cfg.template), cfg.template))
    return out


def load_suite(name: str) -> dict:
    """The settings of suite `name` (a file in evals/ or a path); ValueError when it cannot be used."""
    path = paths.find_named("evals", name)
    if path is None:
        known = paths.available("evals")
        raise ValueError(f"unknown suite {name!r}{did_you_mean(name, known)}; suites in evals/: {', '.join(known)}")
    data = load_yaml(path) or {}
    if not isinstance(data, dict):
        raise ValueError(f"suite file {path} must be a mapping of eval settings")
    bad = sorted(set(data) - set(EvalCfg.model_fields) - SUITE_DOC_KEYS | ({"suite"} & set(data)))
    if bad:
        allowed = ", ".join(k for k in EvalCfg.model_fields if k != "suite")
        raise ValueError(f"suite file {path}: unknown key(s) {bad}; allowed: {allowed}")
    return {k: v for k, v in data.items() if k not in SUITE_DOC_KEYS}


def eval_section(cfg: EvalCfg) -> list[Problem]:
    """Every task name is tunelab's (the TASKS registry), or lm-eval's, or one of eval.include_path's: the latter
    two checked against lm-eval's task index (plan/lmtasks.py), which reads YAML and loads no data."""
    if cfg.include_path and not Path(cfg.include_path).expanduser().is_dir():
        where = Path(cfg.include_path).expanduser()
        return [Problem(("eval", "include_path"), f"no such folder: {where.absolute()} (a folder of lm-eval task "
                        "YAMLs, as lm_eval's --include_path; a relative path is relative to the folder exp runs in, "
                        f"{Path.cwd()})", cfg.include_path)]
    out = []
    for key, names in (("tasks", cfg.tasks), ("limits", list(cfg.limits)), ("subtasks", list(cfg.subtasks))):
        why = {n: lmtasks.refused(n, cfg.include_path) for n in names if n not in TASKS}
        out += [Problem(("eval", key), w) for w in why.values() if w]
        if missing := [n for n, w in why.items() if w == ""]:
            out.append(Problem(("eval", key), lmtasks.unknown(missing, cfg.include_path, TASKS.names())))
    if cfg.include_path and not out:
        ours = [n for n in cfg.tasks if n not in TASKS and n in lmtasks.local(cfg.include_path)]
        out += [Problem(("eval", "tasks"), w) for w in lmtasks.local_problems(ours, cfg.include_path)]
    return out


# The base's two ends, by their names in transformers' causal LMs. Adapters that share one base in a process (a
# together-group, a shared evaluation pass) all go through the same output head and embeddings: an adapter there
# would change the others' path (the loss's chunked head reads a plain weight), and its final/ holds base weights.
SHARED_ENDS = ("lm_head", "embed_tokens", "embed_in", "embed_out", "wte", "wpe", "word_embeddings")


def shared_ends(cfg: CellConfig) -> list[str]:
    """The targets of `cfg`'s adapter that name the base's output head or input embeddings."""
    return [t for t in cfg.peft.target_modules or () if t.rsplit(".", 1)[-1] in SHARED_ENDS]


def peft_across(cfg: CellConfig) -> list[str]:
    """A CUDA-only method with train.device cpu cannot run anywhere; without CUDA on this machine it may still
    run on the machine that runs the cell, so that is checked there."""
    if PEFT[cfg.peft.method].needs_cuda and cfg.train.device == "cpu":
        return [f"peft.method {cfg.peft.method} needs a CUDA device, but train.device is cpu"]
    return []


def batching_across(cfg: CellConfig) -> list[str]:
    if cfg.train.group_by_length and cfg.data.pack:
        return ["train.group_by_length sorts padded rows by length, and with data.pack: true every row is already "
                "full (no padding to save); set one of them to false"]
    return []
