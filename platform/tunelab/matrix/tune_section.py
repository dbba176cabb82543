"""The `tune:` section of a matrix file (and of an `include` entry): what is searched, with which budget,
objective, sampler and pruner. Pure schema and the checks that need only the registries; the checks that need
the cells (a searched key's bounds make valid cells, every group gets the same budget) are in tune/plan.py.
"""

from __future__ import annotations

import builtins
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tunelab.core.registries import INTERMEDIATES, PRUNERS, SAMPLERS, TASKS

KINDS = ("log_uniform", "uniform", "int", "choice")
# Keys a search may not vary: the seed is what retraining repeats, the steps are the budget itself.
NOT_SEARCHED = {"train.seed": "seeds are not a hyperparameter: the winner is retrained with the matrix's `seeds`",
                "train.steps": "train.steps is the budget every trial gets, not a hyperparameter"}
STORAGE_PREFIXES = ("postgresql://", "postgresql+psycopg2://", "sqlite:///")
# What must be the same in every tuned group, so that each gets the same budget and is judged alike.
BUDGET_KEYS = ("trials", "metric", "mode", "sampler", "pruner", "eta", "min_steps", "intermediate", "batch", "seed",
               "storage", "allow_test_selection", "studies", "workloads")
# A study's best value of a searched key this close to an end of its range is "at the edge" (docs/tuning.md, after
# Google's tuning playbook: the best trials should not sit at the boundary of the search space).
EDGE_SHARE = 0.1
SEED_MAX = 2**32 - 1  # numpy's (and so every Optuna sampler's) largest seed


class Dist(BaseModel):
    """One searched key's distribution: exactly one of log_uniform, uniform, int or choice."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    log_uniform: tuple[float, float] | None = Field(None, description="[low, high], 0 < low < high: uniform in log")
    uniform: tuple[float, float] | None = Field(None, description="[low, high], low < high")
    int: tuple[builtins.int, builtins.int] | None = Field(None, description="[low, high], integers, both included")
    choice: builtins.list[Any] | None = Field(None, description="two or more values (numbers, strings, booleans, null)")

    @model_validator(mode="before")
    @classmethod
    def _one_kind(cls, raw: Any) -> Any:
        if not isinstance(raw, dict) or len(raw) != 1:
            raise ValueError(f"a distribution is a mapping with one key of {', '.join(KINDS)}, e.g. "
                             "{log_uniform: [1.0e-6, 1.0e-3]}")
        (kind,) = raw
        if kind not in KINDS:
            raise ValueError(f"unknown distribution {kind!r}; allowed: {', '.join(KINDS)}")
        if kind != "choice" and isinstance(raw[kind], list | tuple) and any(isinstance(b, bool) for b in raw[kind]):
            raise ValueError(f"{kind}: {raw[kind]}: its bounds are numbers, not true/false")
        return raw

    @model_validator(mode="after")
    def _bounds(self) -> Dist:
        if self.choice is not None:
            _check_choice(self.choice)
            return self
        low, high = self.bounds
        if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
            raise ValueError(f"empty range [{low}, {high}]: {self.kind} needs low < high")
        if self.kind == "log_uniform" and low <= 0:
            raise ValueError(f"log_uniform over [{low}, {high}]: a logarithm needs 0 < low (a positive lower bound)")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def bounds(self) -> tuple:
        return getattr(self, self.kind)

    def edge(self, value: Any) -> str | None:
        """"lower" or "upper" when `value` lies at that edge of the range: in its outer tenth (in log space for
        log_uniform), or the first or last value of an int range or of a choice of numbers (sorted); None inside,
        and for a choice of words, which has no order."""
        if self.choice is not None:
            ordered = sorted(v for v in self.choice if _number(v))
            if len(ordered) < len(self.choice) or not _number(value):
                return None
            return "lower" if value == ordered[0] else "upper" if value == ordered[-1] else None
        if not _number(value):
            return None
        low, high = self.bounds
        if self.kind == "int":
            return "lower" if value <= low else "upper" if value >= high else None
        lo, hi, v = (math.log(x) for x in (low, high, value)) if self.kind == "log_uniform" else (low, high, value)
        share = (v - lo) / (hi - lo)
        return "lower" if share < EDGE_SHARE else "upper" if share > 1 - EDGE_SHARE else None

    def edge_zones(self) -> dict[str, list[Any]]:
        """The values that count as each edge, for a figure: [from, to] of a continuous range's outer tenths, the
        end value of an int range or ordered choice; {} for a choice of words."""
        if self.choice is not None:
            ordered = sorted(v for v in self.choice if _number(v))
            return {} if len(ordered) < len(self.choice) else {"lower": [ordered[0]] * 2, "upper": [ordered[-1]] * 2}
        low, high = self.bounds
        if self.kind == "int":
            return {"lower": [low, low], "upper": [high, high]}
        if self.kind == "log_uniform":
            lo, hi = math.log(low), math.log(high)
            inner = [math.exp(lo + EDGE_SHARE * (hi - lo)), math.exp(hi - EDGE_SHARE * (hi - lo))]
        else:
            inner = [low + EDGE_SHARE * (high - low), high - EDGE_SHARE * (high - low)]
        return {"lower": [low, inner[0]], "upper": [inner[1], high]}

    def values(self) -> list[Any]:
        """The values a cell must accept: both bounds, or every choice."""
        return list(self.choice) if self.choice is not None else list(self.bounds)

    def size(self) -> float:
        """Points in the distribution (a grid's size); inf for a continuous one."""
        if self.choice is not None:
            return len(self.choice)
        return self.bounds[1] - self.bounds[0] + 1 if self.kind == "int" else math.inf


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_choice(values: list[Any]) -> None:
    if any(v is not None and not isinstance(v, (bool, int, float, str)) for v in values):
        raise ValueError("choice values are numbers, strings, booleans or null")
    same = [a for i, a in enumerate(values) for b in values[:i]
            if a == b and isinstance(a, bool) == isinstance(b, bool)]
    if same:  # (1 and 1.0 are one value: a grid over them would train one configuration twice)
        raise ValueError(f"{same[0]!r} is named twice in {values}: each value of a choice once")
    if len(values) < 2:
        raise ValueError("a choice needs two or more different values (one value is no search: set it in base)")


class TuneSpec(BaseModel):
    """The `tune:` section (docs/tuning.md). Its budget keys are the same for every tuned group."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    space: dict[str, Dist] = Field(min_length=1, description="dotted config key -> distribution")
    trials: int = Field(gt=0, description="configurations tried per method group (the budget, with train.steps)")
    metric: str = Field("val_loss", description="the task whose score at the full budget is the objective")
    mode: Literal["min", "max"] | None = Field(None, description="minimize or maximize; default: the task's direction")
    sampler: str = Field("qmc", description="qmc, tpe, grid or random")
    pruner: str = Field("none", description="none, halving (synchronous successive halving) or hyperband")
    eta: int | None = Field(None, ge=2, description="halving/hyperband: 1/eta of a rung goes on (default 3)")
    min_steps: int | None = Field(None, gt=0, description="halving/hyperband: the first rung is at least this many "
                                  "steps; the rungs are train.steps / eta^k, rounded (default: train.steps / eta^2)")
    intermediate: str = Field("val_loss", description="what a rung ranks trials by: val_loss (the loop's validation "
                              "loss at the rung step) or checkpoint (tune.metric scored on the rung's checkpoint)")
    batch: int | None = Field(None, gt=0, description="trials sampled per round; default: all of them at once, for "
                              "tpe a quarter (each round sees the rounds before)")
    seed: int = Field(0, ge=0, le=SEED_MAX, description="the sampler's seed (0 .. 2^32 - 1, as Optuna's samplers "
                      "take it)")
    storage: str = Field("journal", description="journal (an Optuna journal file in the runs folder) or a "
                         "postgresql:// / sqlite:/// URL")
    baseline: bool = Field(False, description="also run each group as written (its own values of the searched "
                           "keys), with the matrix's seeds")
    allow_test_selection: bool = Field(False, description="let a test-set score be the objective (its selections "
                                       "are marked)")
    studies: int = Field(1, gt=0, description="repeat each group's search this many times, study s with the "
                         "sampler's seed + s: a tuned row is the median over its studies' winners")
    workloads: list[str] = Field(default_factory=list, description="matrix axes that are workloads (e.g. "
                                 "data.recipe): every method group is tuned on each, and the leaderboard aggregates "
                                 "each method over them (performance profile)")

    @field_validator("trials", "eta", "min_steps", "batch", "seed", "studies", mode="before")
    @classmethod
    def _whole(cls, v: Any) -> Any:
        if isinstance(v, bool):  # (YAML's true would pass as 1)
            raise ValueError(f"{str(v).lower()}: a whole number, not true/false")
        return v

    @field_validator("space")
    @classmethod
    def _keys(cls, v: dict[str, Dist]) -> dict[str, Dist]:
        for key in v:
            if key in NOT_SEARCHED:
                raise ValueError(f"{key}: {NOT_SEARCHED[key]}")
            if "." not in key:
                raise ValueError(f"{key!r}: a searched key is a dotted config key, e.g. optim.lr")
        return v

    @field_validator("metric")
    @classmethod
    def _metric(cls, v: str) -> str:
        # tunelab's tasks, or any task of the eval section (lm-eval's, include_path's): checked against the
        # cells' eval section in tune/plan.py, which also reads such a task's split and direction
        if not v.strip():
            raise ValueError(f"an empty metric; tasks: {', '.join(TASKS)}, or a task of the eval section")
        return v

    @field_validator("workloads")
    @classmethod
    def _workloads(cls, v: list[str]) -> list[str]:
        if len(set(v)) < len(v):
            raise ValueError(f"{v}: a workload axis named twice")
        return v

    @field_validator("sampler")
    @classmethod
    def _sampler(cls, v: str) -> str:
        SAMPLERS.check(v)
        return v

    @field_validator("pruner")
    @classmethod
    def _pruner(cls, v: str) -> str:
        PRUNERS.check(v)
        return v

    @field_validator("intermediate")
    @classmethod
    def _intermediate(cls, v: str) -> str:
        INTERMEDIATES.check(v)
        return v

    @field_validator("storage")
    @classmethod
    def _storage(cls, v: str) -> str:
        if v != "journal" and not v.startswith(STORAGE_PREFIXES):
            raise ValueError(f"{v!r}: journal, or a URL starting with {', '.join(STORAGE_PREFIXES)}")
        if v.startswith("sqlite:///") and v.removeprefix("sqlite:///") in ("", ":memory:"):
            raise ValueError(f"{v!r} is a database in memory: the study would be lost when `exp run` ends (and a "
                             "second runner could not share it); name a file, sqlite:///path/to/study.db")
        return v

    @model_validator(mode="after")
    def _together(self) -> TuneSpec:
        if self.seed + self.studies - 1 > SEED_MAX:
            raise ValueError(f"seed {self.seed} with {self.studies} studies: study s samples with seed + s, and the "
                             f"last, {self.seed + self.studies - 1}, is above {SEED_MAX}")
        if self.metric in TASKS and TASKS[self.metric].split == "test" and not self.allow_test_selection:
            raise ValueError(test_selection_refused(self.metric))
        for key in self.workloads:
            if key in self.space:
                raise ValueError(f"{key} is searched and named a workload axis: a workload is what a method is "
                                 "tuned on, not a hyperparameter")
        if not PRUNERS[self.pruner].rungs and (self.eta is not None or self.min_steps is not None):
            raise ValueError("eta and min_steps set the rungs of pruner halving or hyperband; pruner none has none")
        if self.pruner == "hyperband" and self.batch is not None:  # (tune/schedule.py: brackets are its rounds)
            raise ValueError("batch: hyperband samples each of its brackets as one round; batch sets the rounds of "
                             "pruner none or halving")
        if not PRUNERS[self.pruner].rungs and self.intermediate != "val_loss":
            raise ValueError(f"intermediate {self.intermediate} ranks trials at the rungs of pruner halving or "
                             "hyperband; pruner none has none")
        if SAMPLERS[self.sampler].finite:
            _check_grid(self)
        return self

    @property
    def direction(self) -> str:
        """minimize or maximize (Optuna's words). A metric tunelab does not register has its mode filled in by
        tune/plan.py from the task's own direction."""
        if self.mode is None and self.metric not in TASKS:
            raise ValueError(f"the direction of {self.metric!r} is read from its task at plan time (tune/plan.py)")
        mode = self.mode or ("min" if TASKS[self.metric].lower_is_better else "max")
        return "minimize" if mode == "min" else "maximize"

    @property
    def ranked_by(self) -> str:
        """What a rung ranks trials by, in words (the search's record, `exp plan`)."""
        checkpoint = INTERMEDIATES[self.intermediate].checkpoints
        return f"{self.metric} at the rung checkpoint" if checkpoint else self.intermediate

    @property
    def lower_is_better(self) -> bool:
        """At a rung: the intermediate's own direction, or the objective's."""
        lower = INTERMEDIATES[self.intermediate].lower_is_better
        return self.direction == "minimize" if lower is None else lower

    @property
    def rounds_batch(self) -> int:
        """Trials sampled per round (the sampler sees every trial of the rounds before)."""
        if self.batch is not None:
            return min(self.batch, self.trials)
        return max(1, math.ceil(self.trials / 4)) if SAMPLERS[self.sampler].adaptive else self.trials

    def budget(self) -> dict[str, Any]:
        """The keys that must agree between groups."""
        return {k: getattr(self, k) for k in BUDGET_KEYS}


def test_selection_refused(metric: str) -> str:
    return (f"metric {metric!r} is scored on its test set: choosing hyperparameters on it makes every score it selects "
            "optimistic. Use val_loss (the recipe's held-out split) or a task scored on a validation split, or set "
            "tune.allow_test_selection: true (its selections are then marked)")


def _check_grid(spec: TuneSpec) -> None:
    continuous = [k for k, d in spec.space.items() if d.kind in ("log_uniform", "uniform")]
    if continuous:
        raise ValueError(f"sampler grid needs a finite space (choice or int); {', '.join(continuous)} "
                         "is continuous")
    size = math.prod(d.size() for d in spec.space.values())
    if spec.trials > size:
        raise ValueError(f"sampler grid has {int(size)} points, fewer than trials {spec.trials}")


def merged(base: TuneSpec | None, own: dict[str, Any]) -> dict[str, Any]:
    """An include entry's `tune:` over the matrix-level one, key by key (its `space` replaces the whole space)."""
    return {**(base.model_dump(exclude_unset=True) if base is not None else {}), **own}
