"""Paired significance of a score difference between two cells, over the items both scored.

Each item has a score per side (0/1 for accuracy and exact match, the pass rate of its samples for HumanEval).
The headline is recomputed as the task computes it (micro: the mean over items; macro: the mean of per-subtask
means, BBH). Two tests:
- paired bootstrap (Efron & Tibshirani; Koehn 2004): resample items with replacement (for a macro average
  within each subtask, unless a subtask has a single item), recompute both headlines; the 95% interval of the
  difference and a two-sided p-value (twice the share of resamples on the far side of 0);
- a perplexity (word, byte) or bits per byte: each item is a (log-likelihood, words or bytes) pair and the headline
  a ratio of sums over items (RATIOS), recomputed on each resample;
- exact McNemar for binary items under a micro average: only the items where the sides disagree carry
  information; p from the binomial distribution of those discordant pairs at 1/2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Paired:
    a: float  # headline of side A over the shared items
    b: float
    diff: float  # b - a
    ci: tuple[float, float]  # 95% paired-bootstrap interval of the difference
    p_bootstrap: float
    p_mcnemar: float | None  # binary items, micro average only
    n: int  # items
    discordant: tuple[int, int] | None = None  # (A right B wrong, A wrong B right), binary items

    @property
    def p(self) -> float:
        return self.p_mcnemar if self.p_mcnemar is not None else self.p_bootstrap

    @property
    def test(self) -> str:
        return "McNemar (exact)" if self.p_mcnemar is not None else "paired bootstrap"


# Corpus-level metrics of (log-likelihood, words or bytes) items: a function of sum(ll) / sum(count), as lm-eval's
# weighted_perplexity and bits_per_byte aggregate them.
RATIOS = {"word_perplexity": lambda x: math.exp(-x), "byte_perplexity": lambda x: math.exp(-x),
          "bits_per_byte": lambda x: -x / math.log(2)}


def headline(scores: np.ndarray, groups: np.ndarray, average: str) -> float:
    if average in RATIOS:
        return float(RATIOS[average](scores[:, 0].sum() / scores[:, 1].sum()))
    if average == "macro":
        return float(np.mean([scores[groups == g].mean() for g in np.unique(groups)]))
    return float(scores.mean())


def mcnemar_exact(a: np.ndarray, b: np.ndarray) -> tuple[float, tuple[int, int]]:
    """Two-sided exact McNemar p for paired 0/1 outcomes."""
    only_a = int(((a == 1) & (b == 0)).sum())
    only_b = int(((a == 0) & (b == 1)).sum())
    k, m = min(only_a, only_b), only_a + only_b
    if m == 0:
        return 1.0, (only_a, only_b)
    tail = sum(math.comb(m, i) for i in range(k + 1)) / 2**m
    return min(1.0, 2 * tail), (only_a, only_b)


def paired(a: np.ndarray, b: np.ndarray, groups: np.ndarray, average: str = "micro", resamples: int = 10_000,
           seed: int = 0) -> Paired:
    """a[i], b[i]: the two sides' scores of item i; groups[i]: its subtask (a macro average's bootstrap
    resamples within each)."""
    if len(a) != len(b) or len(a) == 0:
        raise ValueError("paired scores need the same, non-empty items on both sides")
    rng = np.random.default_rng(seed)
    idx = [np.flatnonzero(groups == g) for g in np.unique(groups)]
    if average == "macro" and min(len(ix) for ix in idx) > 1:
        # Within each subtask: every subtask stays present, as a macro average needs them all.
        draws = np.concatenate([rng.choice(ix, size=(resamples, len(ix)), replace=True) for ix in idx], axis=1)
        drawn_groups = np.concatenate([groups[ix] for ix in idx])
        diffs = np.array([headline(b[d], drawn_groups, average) - headline(a[d], drawn_groups, average)
                          for d in draws])
    elif average == "macro":
        # A subtask of one item has no spread to resample within (its draws would all be that item, and
        # the interval would shrink to a point): resample the items of all subtasks together instead, the
        # macro average taken over the subtasks each draw holds.
        draws = rng.integers(0, len(a), size=(resamples, len(a)))
        diffs = np.array([headline(b[d], groups[d], average) - headline(a[d], groups[d], average) for d in draws])
    elif average in RATIOS:  # a ratio of sums over items: resample the items, recompute both
        draws = rng.integers(0, len(a), size=(resamples, len(a)))
        diffs = np.array([headline(b[d], groups[d], average) - headline(a[d], groups[d], average) for d in draws])
    else:  # a micro average is the mean over items: resample the items
        draws = rng.integers(0, len(a), size=(resamples, len(a)))
        diffs = b[draws].mean(1) - a[draws].mean(1)
    ha, hb = headline(a, groups, average), headline(b, groups, average)
    p_boot = min(1.0, 2 * min(float((diffs <= 0).mean()), float((diffs >= 0).mean())))
    if hb == ha:
        p_boot = 1.0
    binary = bool(np.isin(a, (0, 1)).all() and np.isin(b, (0, 1)).all())
    p_mc, disc = mcnemar_exact(a, b) if binary and average == "micro" else (None, None)
    lo, hi = np.percentile(diffs, [2.5, 97.5])
    return Paired(ha, hb, hb - ha, (float(lo), float(hi)), p_boot, p_mc, len(a), disc)
