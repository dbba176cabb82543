"""Plan-time checks of scores along training: eval.checkpoints (its steps, and its evaluation, checked as an eval
section), train.select (a validation metric the checkpoints score; never a test set) and train.keep_best."""

from __future__ import annotations

from pydantic import ValidationError

from tunelab.core.config import CellConfig, CheckpointsCfg, EvalCfg
from tunelab.core.errors import Problem, problems_of
from tunelab.core.registries import ENGINES, TASKS, uses_engine
from tunelab.plan import sections

CK = ("eval", "checkpoints")


def check(cfg: CellConfig) -> list[Problem]:
    """Every problem of a schema-valid cell's checkpoint evaluation and selection."""
    ck, t = cfg.eval.checkpoints, cfg.train
    if ck is None:
        out = []
        if t.select is not None:
            out.append(Problem(("train", "select"), "chooses among the checkpoints eval.checkpoints scores; add "
                               "eval.checkpoints: {every: N} (or {at: [steps]}) scoring the metric's task"))
        if t.keep_best is not None:
            out.append(Problem(("train", "keep_best"), "keeps the best checkpoints of a selection: set train.select"))
        return out
    out = _steps(ck, t.steps)
    engine = ENGINES[cfg.parallel.backend]
    if engine.checkpoints_unreadable and uses_engine(cfg.parallel):
        out.append(Problem(CK, f"parallel.backend {cfg.parallel.backend}: {engine.checkpoints_unreadable}, and "
                           "checkpoint evaluation loads each checkpoint into one process; use backend: native"))
    derived, problems = _evaluation(cfg.eval, ck)
    out += problems
    if t.select is not None and derived is not None:
        out += _select(cfg, derived)
    elif t.select is None and t.keep_best is not None:
        out.append(Problem(("train", "keep_best"), "keeps the best checkpoints of a selection: set train.select"))
    return out


def _steps(ck: CheckpointsCfg, total: int) -> list[Problem]:
    late = [s for s in ck.at or [] if s > total]
    if late:
        return [Problem((*CK, "at"), f"steps {late} come after the last step (train.steps {total})", ck.at)]
    return []


def _where(ck: CheckpointsCfg, loc: tuple) -> tuple:
    """Where in the file a problem of the checkpoints' evaluation comes from: a key of eval.checkpoints, or of
    the eval section it inherits."""
    key = loc[0] if loc else None
    if key in ("tasks", "limit") and getattr(ck, str(key)) is not None:
        return (*CK, *loc)
    if key in ck.settings:
        return (*CK, "settings", *loc)
    return ("eval", *loc)


def _evaluation(ev: EvalCfg, ck: CheckpointsCfg) -> tuple[EvalCfg | None, list[Problem]]:
    """The checkpoints' evaluation settings, checked as an eval section (task names, suite keys)."""
    if "checkpoints" in ck.settings:
        return None, [Problem((*CK, "settings", "checkpoints"), "checkpoints are not evaluated at their checkpoints")]
    try:
        derived = ev.at_checkpoints()
    except ValidationError as e:
        return None, [Problem(_where(ck, p.loc), p.message, p.value) for p in problems_of(e, EvalCfg)]
    assert derived is not None
    return derived, [Problem(_where(ck, p.loc[1:]), p.message, p.value) for p in sections.eval_section(derived)]


def _select(cfg: CellConfig, derived: EvalCfg) -> list[Problem]:
    sel, where = cfg.train.select, ("train", "select", "metric")
    assert sel is not None
    validation = [n for n, spec in TASKS.items() if spec.split == "validation"]
    out = []
    if sel.metric not in TASKS:
        out.append(Problem(where, f"tunelab cannot tell which split {sel.metric!r} scores (it is no registered task); "
                           f"select on one that scores a validation split: {', '.join(validation)}", sel.metric))
    elif TASKS[sel.metric].split != "validation":
        out.append(Problem(where, f"{sel.metric} scores a test set ({TASKS[sel.metric].description}): a checkpoint "
                           "chosen by it would be reported on the set that chose it. Select on a validation "
                           f"metric: {', '.join(validation)}", sel.metric))
    elif sel.metric not in derived.tasks:
        out.append(Problem(where, f"{sel.metric} is not scored at the checkpoints (their tasks: "
                           f"{', '.join(derived.tasks)}); add it to eval.checkpoints.tasks", sel.metric))
    if not cfg.train.save_final:
        out.append(Problem(("train", "save_final"), "train.select writes the chosen checkpoint to final/, which "
                           "save_final: false turns off"))
    return out
