"""Plan-time checks: everything about a cell that needs a registry, a content folder or several sections.

`exp plan`, `exp run` and `matrix.expand` build every cell through `cell_config`, so a combination that
cannot train fails before anything runs, with the key path of the file that set it. Nothing here asks
the machine (CUDA, local folders): a matrix plans the same on a laptop, a login node or a GPU box; the
machine is checked where the cell runs (`tunelab.machine.runtime.check_host`).

May import: core, folders, optimizers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from tunelab.core import layouts
from tunelab.core.config import CellConfig, DataCfg, EvalCfg, ModelCfg
from tunelab.core.errors import Invalid, Problem, problems_of
from tunelab.plan import checkpoint_scores, optim, sections

__all__ = ["Invalid", "Problem", "cell_config", "check", "eval_config", "section_config"]


def cell_config(raw: dict[str, Any]) -> CellConfig:
    """A raw cell (a mapping as in YAML) -> a checked CellConfig; raises `Invalid` with every problem."""
    return _validated(CellConfig, _with_suite(raw, ("eval",)), check)


SECTIONS: dict[str, tuple[type, Callable[[Any], list[Problem]]]] = {
    "model": (ModelCfg, sections.model_section), "data": (DataCfg, sections.data_section),
    "eval": (EvalCfg, sections.eval_section)}


def section_config(key: str, raw: dict[str, Any]):
    """One section alone (the stage CLIs: `exp eval run`, `exp data ...`), checked as in a cell; the problems'
    locs are relative to the section."""
    cls, checks = SECTIONS[key]
    raw = _with_suite({key: raw}, ())[key] if key == "eval" else raw
    return _validated(cls, raw, lambda cfg: [Problem(p.loc[1:], p.message, p.value) for p in checks(cfg)])


def _validated(cls, raw: dict, checks):
    """The schema first (pydantic's errors as Problems), then the plan-time checks; Invalid with all of them."""
    try:
        cfg = cls.model_validate(raw)
    except ValidationError as e:
        raise Invalid(problems_of(e, cls)) from None
    problems = checks(cfg)
    if problems:
        raise Invalid(problems)
    return cfg


def eval_config(raw: dict[str, Any]) -> EvalCfg:
    return section_config("eval", raw)


def _with_suite(raw: dict, prefix: tuple) -> dict:
    """The eval section with its suite's settings as defaults (keys the cell sets win); the checkpoints' suite
    (eval.checkpoints.suite) put into eval.checkpoints.settings the same way."""
    ev = raw.get("eval") if isinstance(raw, dict) else None
    if not isinstance(ev, dict):
        return raw
    ck = ev.get("checkpoints")
    if isinstance(ck, dict) and _named(ck) and isinstance(ck.get("settings", {}), dict):
        keys = _suite(ck["suite"], (*prefix, "checkpoints", "suite"))
        ev = {**ev, "checkpoints": {**ck, "settings": {**keys, **ck.get("settings", {})}}}
    if not _named(ev):
        return {**raw, "eval": ev}  # no suite, or not a name: the schema says what is wrong with it
    return {**raw, "eval": {**_suite(ev["suite"], (*prefix, "suite")), **ev}}


def _named(section: dict) -> bool:
    return bool(section.get("suite")) and isinstance(section["suite"], str)


def _suite(name: str, loc: tuple) -> dict:
    try:
        return sections.load_suite(name)
    except ValueError as e:
        raise Invalid([Problem(loc, str(e), name)]) from None


def check(cfg: CellConfig) -> list[Problem]:
    """Every plan-time problem of a schema-valid cfg: the sections, then how they fit together."""
    problems = [*sections.model_section(cfg.model), *sections.data_section(cfg.data),
                *optim.section(cfg.optim), *sections.eval_section(cfg.eval), *layouts.section(cfg.parallel)]
    if problems:  # cross-section checks assume each section is sound
        return problems
    across = (optim.compatible(cfg) + layouts.across(cfg) + sections.peft_across(cfg)
              + sections.batching_across(cfg))
    return ([Problem((), "; ".join(across))] if across else []) + checkpoint_scores.check(cfg)
