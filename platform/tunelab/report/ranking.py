"""How often one tuned method ranks above another when its studies and seeds are drawn again.

A tuned row (tune.studies: S, the matrix's seeds: K) has a score per study and seed: study s's winner retrained
with seed k. The row's value is the median over the studies of each study's mean over its seeds (AlgoPerf's
median over studies). The question "is A above B, or did its search get lucky?" is answered by a bootstrap
over both sources of luck (Efron & Tibshirani 1993, the two-stage bootstrap of hierarchical data: Davison &
Hinkley 1997, 3.8): draw S studies with replacement, within each drawn study K seeds with replacement,
recompute both rows' values, and count the draws in which A's is better (a tie counts half). The draws are
paired: study s of two groups searched the same points (the same sampler seed) and seed k is the same seed, so
both rows are redrawn with the same indices. Seeded: the same data and seed give the same share.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tunelab.report.records import Record


@dataclass(frozen=True)
class Ranking:
    task: str
    a: float  # each row's value: the median over studies of the mean over seeds
    b: float
    above: float  # share of the resamples in which A ranks above B (ties count half)
    studies: int
    seeds: int
    resamples: int


def value(scores: np.ndarray) -> float:
    """scores[study, seed] -> the median over studies of each study's mean over its seeds."""
    return float(np.median(scores.mean(axis=1)))


def above(a: np.ndarray, b: np.ndarray, higher_is_better: bool, resamples: int = 10_000, seed: int = 0) -> float:
    """a[s, k], b[s, k]: the two rows' scores by study and seed (the same studies and seeds). The share of paired
    two-stage bootstrap draws in which A's value is better than B's, ties half."""
    if a.shape != b.shape or a.ndim != 2 or 0 in a.shape:
        raise ValueError("both rows need scores for the same studies and seeds")
    n_studies, n_seeds = a.shape
    rng = np.random.default_rng(seed)
    studies = rng.integers(0, n_studies, size=(resamples, n_studies))
    seeds = rng.integers(0, n_seeds, size=(resamples, n_studies, n_seeds))
    va = np.median(a[studies[..., None], seeds].mean(axis=2), axis=1)
    vb = np.median(b[studies[..., None], seeds].mean(axis=2), axis=1)
    better = va > vb if higher_is_better else va < vb
    return float((better.sum() + 0.5 * (va == vb).sum()) / resamples)


def rank(task: str, a: dict[tuple[int, int], float], b: dict[tuple[int, int], float], higher_is_better: bool,
         resamples: int = 10_000, seed: int = 0) -> Ranking | None:
    """The two rows' scores keyed by (study, seed): the studies where both have every common seed; None when
    they share none."""
    seeds = sorted({k for _, k in a} & {k for _, k in b})
    studies = sorted(s for s in {s for s, _ in a} & {s for s, _ in b}
                     if all((s, k) in a and (s, k) in b for k in seeds))
    if not studies or not seeds:
        return None
    ma, mb = (np.array([[side[(s, k)] for k in seeds] for s in studies]) for side in (a, b))
    return Ranking(task, value(ma), value(mb), above(ma, mb, higher_is_better, resamples, seed), len(studies),
                   len(seeds), resamples)


def _by_study_seed(rows: list[Record], task: str) -> dict[tuple[int, int], float]:
    return {(int(r.tune.get("study_index") or 0), int(r.config.get("train.seed") or 0)): float(s.value)
            for r in rows if r.state == "done" and (s := r.scores.get(task)) and s.ok and s.value is not None}


def of_rows(task: str, a: list[Record], b: list[Record], resamples: int = 10_000, seed: int = 0) -> Ranking | None:
    """Two tuned rows' runs (each study's winner, once per seed) on one task; None without shared scores."""
    first = next((s for r in a if (s := r.scores.get(task))), None)
    if first is None:
        return None
    return rank(task, _by_study_seed(a, task), _by_study_seed(b, task), first.higher_is_better, resamples, seed)
