"""Method groups of a matrix with a `tune:` section, checked at plan time.

A method group is a combo of the matrix (an axis value or an include entry) that a `tune:` section applies to:
the cells that differ only in the searched keys. Every group gets the same budget (trials x train.steps, the
same sampler, pruner and objective), or the file is refused. Every searched key is checked by building the cell
at each end of its range (each choice), so a bound no cell accepts is refused with its key path before anything
runs.
"""

from __future__ import annotations

import copy
import fnmatch
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tunelab.core.config import CellConfig, content_id
from tunelab.core.errors import Errors, UserError
from tunelab.core.keys import set_dotted
from tunelab.core.registries import INTERMEDIATES, PRUNERS, TASKS
from tunelab.matrix import expansion, input_checks
from tunelab.matrix.schema import MatrixFile
from tunelab.matrix.sets import cell_sets
from tunelab.matrix.tune_section import TuneSpec
from tunelab.tune import objective, workloads
from tunelab.tune import schedule as sched


@dataclass(frozen=True)
class Group:
    slug: str
    spec: TuneSpec
    tune_at: str  # where its tune section is in the file: tune, or include[j].tune
    raw: dict[str, Any]  # the cell as written (base + its keys + --set), the search seed set
    config: CellConfig  # that cell, checked: what the group trains with the values the file gives
    varying: dict[str, Any]  # the keys that tell the groups apart
    seeds: tuple[int, ...]  # the winner is retrained with each; trials train with the first
    schedule: sched.Schedule
    on_test: bool = False  # its objective is scored on a test set (tune.allow_test_selection let it)
    study_index: int = 0  # which of the group's tune.studies this search is (tune/studies.py)

    def identity(self) -> dict[str, Any]:
        """What decides the search's trials: the trial cell without the searched keys, and the search itself."""
        cfg = self.config.model_dump(mode="json", exclude={"tracking"})
        cfg["eval"] = {**cfg["eval"], "tasks": [self.spec.metric]}
        for key in self.spec.space:
            _pop_dotted(cfg, key)
        # How many studies there are, and which axes are workloads, decide no trial of this one
        search = self.spec.model_dump(mode="json", exclude={"storage", "baseline", "studies", "workloads"})
        if search["intermediate"] == "val_loss":  # added later: at its default, studies keep their names
            del search["intermediate"]
        return {"cell": cfg, "search": search}

    @property
    def tag(self) -> str:
        """What tells a group's studies apart in names: "-st2" (none when the group has one study)."""
        return f"-st{self.study_index}" if self.spec.studies > 1 else ""

    @property
    def study(self) -> str:
        """The Optuna study's name: readable, and new whenever what decides the trials changes. Study 0 keeps the
        name of the group's single study (the same search: raising tune.studies adds studies beside it)."""
        return f"{self.slug}{self.tag if self.study_index else ''}-{content_id(self.identity())}"

    @property
    def label(self) -> str:
        """The group as messages name it: "adamw", or "adamw (study 2 of 3)"."""
        return self.slug + (f" (study {self.study_index + 1} of {self.spec.studies})" if self.spec.studies > 1
                            else "")


def _pop_dotted(d: dict, key: str) -> None:
    *parents, last = key.split(".")
    for p in parents:
        nxt = d.get(p)
        d = nxt if isinstance(nxt, dict) else {}
    d.pop(last, None)


@dataclass(frozen=True)
class _Tuned:
    """A combo a tune: section applies to, with its section, its raw cell and that cell checked."""

    combo: expansion.Combo
    spec: TuneSpec
    raw: dict[str, Any]
    config: CellConfig


def groups(spec: MatrixFile, path: Path, sets: dict[str, Any] | None = None,
           errors: Errors | None = None) -> list[Group]:
    """The method groups of a matrix file (none without a `tune:` section); bad sections raise UserError, every
    one of the file at once (`errors`: expansion.load's, raised here with these added). `spec` is
    expansion.load's (with --set's matrix-level keys applied); `sets` every --set."""
    errors = Errors(path) if errors is None else errors
    found = _groups(spec, path, sets, errors)
    errors.raise_any()
    return found


def _groups(spec: MatrixFile, path: Path, sets: dict[str, Any] | None, errors: Errors) -> list[Group]:
    built: list[_Tuned] = []
    seen: set[str] = set()
    for combo in expansion.combos(spec, path):
        if combo.tune is None:
            continue
        try:
            raw, config = _group_cell(spec, combo, combo.tune, path, cell_sets(sets), errors)
        except UserError as e:
            errors.add(e)
            continue
        key = content_id({"cell": _without(config, combo.tune), "tune": combo.tune.model_dump(mode="json")})
        if key not in seen:  # two combos that differ only in searched keys (the base, an include) are one group
            seen.add(key)
            built.append(_Tuned(combo, combo.tune, raw, config))
    if not built:
        return []
    with errors.collecting():
        _same_budget(built, path)
    with errors.collecting():
        workloads.check(spec, [(t.spec, t.combo.tune_at) for t in built], path)
    if errors:
        return []
    input_checks.check([t.config for t in built], path)
    cells = [(t.config, {k: v for k, v in t.combo.picks.items() if k not in t.spec.space}) for t in built]
    out = []
    for written, cell in zip(built, expansion.named(spec.name, cells)):
        seeds = tuple(spec.seeds) if spec.seeds is not None else (written.config.train.seed,)
        with errors.collecting():
            tune, on_test = objective.resolved(written.spec, written.config, path, written.combo.tune_at)
            t = replace(written, spec=tune)
            schedule = _schedule(t.spec, t.config, path, t.combo.tune_at)
            if INTERMEDIATES[t.spec.intermediate].checkpoints:
                _check_rung_checkpoints(t, schedule, path)
            out.append(Group(cell.slug, t.spec, t.combo.tune_at, t.raw, t.config, cell.varying, seeds, schedule,
                             on_test))
    return _studies(out)

def _studies(groups: list[Group]) -> list[Group]:
    """Repeated studies (tune.studies: S): each group once per study, study s sampling with seed tune.seed + s and
    the group's whole budget (tune.trials). Independent seeds, not one sequence split in S parts (AlgoPerf
    partitions its S x O quasi-random points at random into studies of O): each study draws its own scrambled
    Sobol sequence (a randomized quasi-Monte Carlo replicate, Owen 1997), so the studies are independent draws of
    "the search a method gets", which is what the bootstrap over studies resamples, and it holds for every sampler
    (TPE's rounds cannot be split). Study 0 is the search a single study runs: raising studies keeps it. Study s
    of two groups with the same space draws the same points, so the comparison stays paired study by study."""
    return [replace(g, spec=g.spec.model_copy(update={"seed": g.spec.seed + s}), study_index=s)
            for g in groups for s in range(g.spec.studies)]


def trial_raw(raw: dict[str, Any], spec: TuneSpec, schedule: sched.Schedule, trial: int) -> dict[str, Any]:
    """A trial's raw cell: evaluated on the objective's task only and, when its rungs are ranked by a checkpoint
    score, that task on the checkpoints of its bracket's rungs, scored by the cell itself before it stops at one
    (workers 0: the score is what the search waits for, nothing trains meanwhile)."""
    out = copy.deepcopy(raw)
    set_dotted(out, "eval.tasks", [spec.metric])
    rungs = [r for r in schedule.bracket_of(trial).rungs if r < schedule.full]  # none: Hyperband's last bracket
    if INTERMEDIATES[spec.intermediate].checkpoints and rungs:
        set_dotted(out, "eval.checkpoints", {"at": rungs, "workers": 0})
    return out


def _check_rung_checkpoints(t: _Tuned, schedule: sched.Schedule, path: Path) -> None:
    """intermediate: checkpoint sets the trials' eval.checkpoints: the cell must not have its own, and the trial
    must be a valid cell with it (e.g. DeepSpeed's checkpoints cannot be evaluated)."""
    at = f"{t.combo.tune_at}.intermediate"
    own = [k for k, v in (("eval.checkpoints", t.config.eval.checkpoints), ("train.select", t.config.train.select))
           if v is not None]
    if own:
        raise UserError(f"intermediate {t.spec.intermediate} scores the trials' rung checkpoints, which the search "
                        f"sets as their eval.checkpoints; the tuned cell sets {' and '.join(own)} itself. Use "
                        "intermediate: val_loss, or drop them from the tuned cells", file=path, key=at)
    probe = trial_raw(t.raw, t.spec, schedule, 0)
    expansion.checked(probe, path, {"eval.checkpoints": f"{at} (the trials' eval.checkpoints)"}, "trial 0")


def _without(config: CellConfig, spec: TuneSpec) -> dict:
    dump = config.model_dump(mode="json")
    for key in spec.space:
        _pop_dotted(dump, key)
    return dump


def _group_cell(spec: MatrixFile, combo: expansion.Combo, tune: TuneSpec, path: Path,
                sets: dict[str, Any], errors: Errors) -> tuple[dict, CellConfig]:
    """The group's cell as written (at the search seed), and every searched key checked at its bounds (each
    bound's problem into `errors`)."""
    at = combo.tune_at
    for key in tune.space:
        if key in spec.matrix:
            raise UserError(f"{key} is a matrix axis and searched by {at}.space: search it, or list its values",
                            file=path, key=f"{at}.space.{key}")
        if key in sets:
            raise UserError(f"--set {key}: the key is searched by {at}.space", file=path, key=f"{at}.space.{key}")
    picks = dict(combo.picks)
    if spec.seeds is not None:
        if "train.seed" in picks:
            raise UserError("set train.seed either in 'seeds' or in the matrix, not both", file=path, key="seeds")
        picks["train.seed"] = spec.seeds[0]
    raw = expansion.raw_cell(spec, picks, sets)
    where = {**combo.origins, "train.seed": "seeds[0]", **{k: f"--set {k}" for k in sets}}
    label = "cell " + ", ".join(f"{k}={v}" for k, v in combo.picks.items()) if combo.picks else "base"
    try:
        config = expansion.checked(raw, path, where, label)
    except UserError as e:
        config, failed = None, e  # its bounds are still checked: their own problems are said with it
    for key, dist in tune.space.items():
        for value in dist.values():  # a key's first bad bound says what is wrong with it
            probe = copy.deepcopy(raw)
            set_dotted(probe, key, value)
            try:
                expansion.checked(probe, path, {**where, key: f"{at}.space.{key} (at {json.dumps(value)})"}, label)
            except UserError as e:
                errors.add(e)
                break
    if config is None:
        raise failed
    if PRUNERS[tune.pruner].rungs and not config.train.resume:
        raise UserError(f"pruner {tune.pruner} continues promoted trials from their rung checkpoints: "
                        "train.resume must stay true", file=path, key=f"{at}.pruner")
    return raw, config


def _same_budget(built: list[_Tuned], path: Path) -> None:
    """Every group gets the same budget: the same trials, steps, sampler, pruner and objective."""
    first = built[0]
    for t in built[1:]:
        for key, value in t.spec.budget().items():
            if value != first.spec.budget()[key]:
                raise UserError(f"{key} {value!r} differs from {first.combo.tune_at}.{key} "
                                f"{first.spec.budget()[key]!r}: every method group gets the same budget "
                                "(only the space may differ)", file=path, key=f"{t.combo.tune_at}.{key}")
        if t.config.train.steps != first.config.train.steps:
            raise UserError(f"train.steps {t.config.train.steps} differs from {first.config.train.steps} in another "
                            "tuned group: every method group gets the same budget (trials x train.steps)",
                            file=path, key=t.combo.tune_at)


def _schedule(tune: TuneSpec, config: CellConfig, path: Path, at: str) -> sched.Schedule:
    try:
        return sched.build(tune.pruner, tune.trials, config.train.steps, eta=tune.eta or 3,
                           min_steps=tune.min_steps, batch=tune.rounds_batch)
    except sched.ScheduleError as e:
        raise UserError(str(e), file=path, key=f"{at}.min_steps" if tune.min_steps else f"{at}.pruner") from None


def select(groups_: list[Group], only: str | None) -> list[Group]:
    """`exp run --only GLOB` for groups: by their slug (or their study's name)."""
    if not only:
        return groups_
    return [g for g in groups_ if fnmatch.fnmatch(g.slug, only) or fnmatch.fnmatch(g.study, only)]


def warnings(spec: MatrixFile, path: Path) -> list[str]:
    """What a tune: section does that the file may not mean: an include entry's (or axis's) own value of a searched
    key never runs while tune.baseline is off (the search replaces it); a mode against its metric's own direction
    (tunelab's tasks: `mode: max` on val_loss searches for the worst)."""
    unused: dict[str, list[str]] = {}
    against: dict[str, str] = {}
    for combo in expansion.combos(spec, path):
        t = combo.tune
        if t is not None and t.mode is not None and t.metric in TASKS:
            own = "min" if TASKS[t.metric].lower_is_better else "max"
            if t.mode != own:
                against[combo.tune_at] = (f"{combo.tune_at}.mode {t.mode} on {t.metric}, whose better scores are "
                                          f"{'lower' if own == 'min' else 'higher'}: the search looks for its worst "
                                          f"(leave mode out to take the task's own direction)")
        if combo.tune is None or combo.tune.baseline:
            continue
        for key in combo.tune.space:
            if key in combo.picks:
                unused.setdefault(combo.tune_at, []).append(f"{combo.origins[key]} = {combo.picks[key]}")
    out = []
    for at, values in unused.items():
        never = "these values never run" if len(values) > 1 else "this value never runs"
        out.append(f"{', '.join(values)}: searched by {at}.space, so {never} (the search replaces it); "
                   "tune.baseline: true also runs each group with its own value (the leaderboard's `default` rows)")
    return out + list(against.values())
