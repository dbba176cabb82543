"""Trial points from Optuna's samplers, the same whoever asks and whenever: every call replays the search in an
in-memory study with a freshly seeded sampler, bracket by bracket: the trials of a bracket are asked together,
then told what they scored (in trial-number order), then the next bracket is asked. So trial k's point depends
on the matrix file, the seed and the results of the brackets before it, never on how many runners ran them or
in which order they finished (Optuna's own distributed mode shares one live study and is not reproducible).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.samplers import BaseSampler, GridSampler, QMCSampler, RandomSampler, TPESampler
from optuna.trial import TrialState

from tunelab.core.registries import SAMPLERS
from tunelab.matrix.tune_section import Dist, TuneSpec
from tunelab.tune.schedule import Schedule


@dataclass(frozen=True)
class Told:
    """What a finished trial tells the sampler: its values at the rungs and its end."""

    intermediate: dict[int, float] = field(default_factory=dict)
    state: str = "complete"  # complete | pruned | failed (no usable objective)
    value: float | None = None


def distribution(d: Dist) -> BaseDistribution:
    if d.choice is not None:
        return CategoricalDistribution(d.choice)
    low, high = d.bounds
    if d.kind == "int":
        return IntDistribution(low, high)
    return FloatDistribution(low, high, log=d.kind == "log_uniform")


def distributions(spec: TuneSpec) -> dict[str, BaseDistribution]:
    return {key: distribution(d) for key, d in spec.space.items()}


class _SpaceQMC(QMCSampler):
    """Optuna's QMC sampler draws its first trial at random and learns the space from it; told the space up
    front, trial k is the k-th point of the scrambled Sobol sequence from the first trial on."""

    def __init__(self, space: dict[str, BaseDistribution], seed: int) -> None:
        with warnings.catch_warnings():  # "experimental": its points are what this file pins, not its interface
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            super().__init__(qmc_type="sobol", scramble=True, seed=seed, warn_independent_sampling=False)
        self._space = space

    def infer_relative_search_space(self, study: optuna.Study, trial: Any) -> dict[str, BaseDistribution]:
        return dict(self._space)


def qmc(spec: TuneSpec, space: dict[str, BaseDistribution], first_round: int) -> BaseSampler:
    return _SpaceQMC(space, spec.seed)


def random(spec: TuneSpec, space: dict[str, BaseDistribution], first_round: int) -> BaseSampler:
    return RandomSampler(seed=spec.seed)


def grid(spec: TuneSpec, space: dict[str, BaseDistribution], first_round: int) -> BaseSampler:
    points = {k: list(d.choices) if isinstance(d, CategoricalDistribution) else
              list(range(d.low, d.high + 1)) if isinstance(d, IntDistribution) else [] for k, d in space.items()}
    return GridSampler(points, seed=spec.seed)


def tpe(spec: TuneSpec, space: dict[str, BaseDistribution], first_round: int) -> BaseSampler:
    # The first round has nothing to learn from: it is TPE's random start-up.
    return TPESampler(seed=spec.seed, n_startup_trials=first_round)


def points(spec: TuneSpec, schedule: Schedule, told: list[list[Told]]) -> list[list[dict[str, Any]]]:
    """The points of brackets 0 .. len(told): the brackets `told` reports on, then the next one."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = distributions(spec)
    sizes = [b.sizes[0] for b in schedule.brackets]
    sampler = SAMPLERS[spec.sampler].make.load()(spec, space, sizes[0])
    study = optuna.create_study(sampler=sampler, direction="minimize" if spec.direction == "minimize" else "maximize")
    out = []
    for b in range(min(len(told) + 1, len(sizes))):
        trials = [study.ask(space) for _ in range(sizes[b])]
        out.append([t.params for t in trials])
        for trial, result in zip(trials, told[b] if b < len(told) else []):
            for step, value in sorted(result.intermediate.items()):
                trial.report(value, step)
            if result.state == "complete" and result.value is not None and not math.isnan(result.value):
                study.tell(trial, result.value)
            else:
                study.tell(trial, state=TrialState.PRUNED if result.state == "pruned" else TrialState.FAIL)
    return out
