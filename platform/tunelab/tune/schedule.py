"""A search's schedule, fixed before anything runs: brackets of trials, the rungs (steps) each bracket stops at,
and how many trials go on at each rung. Pure arithmetic, so `exp plan` can show the compute budget.

A bracket is one round of sampling: its trials are drawn together (seeing every trial of the brackets before)
and go through its rungs synchronously: all of a rung's trials reach its step, then the best
`sizes[i + 1]` of them continue (successive halving; Li et al., "Hyperband", JMLR 2018). The last rung is the
full budget (`train.steps`), so the trials that reach it trained exactly as without pruning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class ScheduleError(ValueError):
    """The rungs a tune section asks for do not fit its budget (said in words, for `tune.*` errors)."""


@dataclass(frozen=True)
class Bracket:
    rungs: tuple[int, ...]  # the steps its trials stop at; the last one is the full budget
    sizes: tuple[int, ...]  # trials at each rung; sizes[0] are sampled for the bracket

    def steps(self) -> int:
        """Optimizer steps the bracket trains: a promoted trial continues from its rung checkpoint."""
        starts = (0, *self.rungs[:-1])
        return sum(n * (r - s) for n, r, s in zip(self.sizes, self.rungs, starts))


@dataclass(frozen=True)
class Schedule:
    brackets: tuple[Bracket, ...]
    full: int  # train.steps: the budget of one trial

    @property
    def trials(self) -> int:
        return sum(b.sizes[0] for b in self.brackets)

    def planned_steps(self) -> int:
        return sum(b.steps() for b in self.brackets)

    def full_steps(self) -> int:
        """What the same trials would train without pruning."""
        return self.trials * self.full

    def first_trial(self, bracket: int) -> int:
        return sum(b.sizes[0] for b in self.brackets[:bracket])

    def bracket_of(self, trial: int) -> Bracket:
        """The bracket trial number `trial` belongs to (trials are numbered bracket after bracket)."""
        for b, bracket in enumerate(self.brackets):
            if trial < self.first_trial(b) + bracket.sizes[0]:
                return bracket
        raise IndexError(f"trial {trial} is past the schedule's {self.trials} trials")

    def describe(self) -> str:
        """One line per bracket: 'steps 7/20/60: 9 -> 3 -> 1 trials'."""
        return "; ".join(f"steps {'/'.join(map(str, b.rungs))}: {' -> '.join(map(str, b.sizes))}"
                         for b in self.brackets)


def rung_steps(full: int, eta: int, min_steps: int) -> tuple[int, ...]:
    """full / eta^k, ..., full / eta, full: the most rungs from min_steps up whose ratio is eta."""
    if min_steps >= full:
        raise ScheduleError(f"min_steps {min_steps} leaves no rung below the full budget of {full} steps")
    k = 0
    while min_steps * eta ** (k + 1) <= full:
        k += 1
    if k == 0:
        raise ScheduleError(f"min_steps {min_steps} x eta {eta} exceeds the full budget of {full} steps: one rung "
                            "is no pruning; lower min_steps or eta")
    rungs = tuple(dict.fromkeys(max(1, round(full / eta ** (k - i))) for i in range(k + 1)))
    return rungs


def _halving(n: int, eta: int, levels: int) -> tuple[int, ...]:
    sizes = [n]
    for _ in range(levels - 1):
        sizes.append(max(1, sizes[-1] // eta))
    return tuple(sizes)


def _chunks(trials: int, batch: int) -> list[int]:
    return [min(batch, trials - i) for i in range(0, trials, batch)]


def build(pruner: str, trials: int, full: int, *, eta: int = 3, min_steps: int | None = None,
          batch: int | None = None) -> Schedule:
    """The schedule of a `tune:` section (pruner none, halving or hyperband) for trials of `full` steps."""
    batch = batch or trials
    if pruner == "none":
        return Schedule(tuple(Bracket((full,), (n,)) for n in _chunks(trials, batch)), full)
    rungs = rung_steps(full, eta, min_steps or max(1, full // eta**2))
    if pruner == "halving":
        return Schedule(tuple(Bracket(rungs, _halving(n, eta, len(rungs))) for n in _chunks(trials, batch)), full)
    if pruner == "hyperband":
        return Schedule(_hyperband(trials, rungs, eta), full)
    raise ScheduleError(f"unknown pruner {pruner!r}")


def _hyperband(trials: int, rungs: tuple[int, ...], eta: int) -> tuple[Bracket, ...]:
    """Hyperband's brackets s = K..0 (bracket s starts at rung K - s), with `trials` split between them in
    Hyperband's proportions n_s = ceil((K + 1) / (s + 1) * eta^s), rounded by largest remainder, at least one each."""
    k = len(rungs) - 1
    if trials < k + 1:
        raise ScheduleError(f"hyperband over {k + 1} rungs has {k + 1} brackets and needs at least {k + 1} trials "
                            f"(got {trials}); use more trials or pruner halving")
    weights = [math.ceil((k + 1) / (s + 1) * eta**s) for s in range(k, -1, -1)]
    shares = [trials * w / sum(weights) for w in weights]
    counts = [math.floor(x) for x in shares]
    order = sorted(range(len(shares)), key=lambda i: (counts[i] - shares[i], i))  # largest remainder first
    for i in order[: trials - sum(counts)]:
        counts[i] += 1
    while 0 in counts:  # every bracket runs at least one trial, taken from the largest
        counts[counts.index(max(counts))] -= 1
        counts[counts.index(0)] += 1
    return tuple(Bracket(rungs[k - s:], _halving(n, eta, s + 1)) for s, n in zip(range(k, -1, -1), counts))


def promote(values: list[tuple[int, float | None]], keep: int, lower_is_better: bool) -> list[int]:
    """The trials that go on from a rung: the best `keep` values, ties broken by trial number; a missing or NaN
    value (a diverged run) ranks last. Depends on nothing but the values, never on the order they came in."""
    def key(item: tuple[int, float | None]) -> tuple[bool, float, int]:
        number, v = item
        if v is None or math.isnan(v):
            return True, 0.0, number
        return False, v if lower_is_better else -v, number

    return [number for number, _ in sorted(values, key=key)[:keep]]
