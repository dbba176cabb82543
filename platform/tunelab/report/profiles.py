"""A method's standing over several workloads (`tune.workloads`): its performance profile and one score.

Dolan & Moré (2002), "Benchmarking optimization software with performance profiles": on each workload w every
method s has a result t[s, w]; its performance ratio is r[s, w] = t[s, w] / min over methods of t[., w] (>= 1, 1 for
the best), and its profile rho_s(tau) the share of workloads where r[s, w] <= tau. AlgoPerf (Dahl et al. 2023,
"Benchmarking Neural Network Training Algorithms"; its DOCUMENTATION.md, "Benchmark score using performance
profiles") ranks by the area under the profile up to r_max = 4, normalised: B_s = 1 / (tau_max - 1) * integral from
1 to tau_max of rho_s(tau) dtau, in [0, 1], higher better.

AlgoPerf's t is a training time (lower is better). Here t is the tuned row's score on the search's objective: a
lower-is-better score (a loss) gives r = t / best, a higher-is-better one (an accuracy) r = best / t. A ratio needs
positive numbers: a missing score, or one <= 0, counts as never within any tau (AlgoPerf's infinite time for a run
that misses its target). rho is a step function, so the area is exact: each workload with r <= tau_max adds
(tau_max - r) / (tau_max - 1) / n.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TAU_MAX = 4.0  # AlgoPerf's r_max: past 4x the best, a method gets no credit on a workload
TAUS = (1.0, 1.25, 1.5, 2.0, 3.0, TAU_MAX)  # where the leaderboard's table reads each profile


@dataclass
class Profile:
    method: str
    ratios: dict[str, float] = field(default_factory=dict)  # workload -> r (inf: no usable score)

    @property
    def workloads(self) -> int:
        return len(self.ratios)

    def rho(self, tau: float) -> float:
        """The share of workloads where the method is within a factor tau of the best."""
        return sum(r <= tau for r in self.ratios.values()) / len(self.ratios) if self.ratios else 0.0

    def score(self, tau_max: float = TAU_MAX) -> float:
        """The area under rho from 1 to tau_max over (tau_max - 1): 1 when best everywhere, 0 when never within
        tau_max of the best."""
        if not self.ratios:
            return 0.0
        return sum(max(0.0, tau_max - r) for r in self.ratios.values()) / (tau_max - 1) / len(self.ratios)


def ratios(results: dict[str, dict[str, float | None]], higher_is_better: bool) -> dict[str, dict[str, float]]:
    """results[method][workload] -> r[method][workload] over every workload any method has (a method without a
    result there, or with one <= 0, gets inf). A workload where no method has a usable result is left out."""
    workloads = list(dict.fromkeys(w for by in results.values() for w in by))
    out: dict[str, dict[str, float]] = {m: {} for m in results}
    for w in workloads:
        usable = {m: float(v) for m, by in results.items() if (v := by.get(w)) is not None and _usable(v)}
        if not usable:
            continue
        best = max(usable.values()) if higher_is_better else min(usable.values())
        for m in results:
            v = usable.get(m)
            out[m][w] = math.inf if v is None else (best / v if higher_is_better else v / best)
    return out


def _usable(v: float) -> bool:
    return math.isfinite(v) and v > 0


def profiles(results: dict[str, dict[str, float | None]], higher_is_better: bool) -> list[Profile]:
    """Each method's profile, best score first (ties by name)."""
    out = [Profile(m, r) for m, r in ratios(results, higher_is_better).items()]
    return sorted(out, key=lambda p: (-p.score(), p.method))
