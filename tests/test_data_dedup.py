"""Deduplication: exact on normalized text, near-duplicates by MinHash LSH."""

from __future__ import annotations

import random

import numpy as np

from tunelab.data.dedup import bands_for, exact_keep, near_keep, signatures

WORDS = [f"w{i}" for i in range(2000)]


def _docs(n: int, seed: int = 0) -> list[str]:
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(r.randint(60, 120))) for _ in range(n)]


def _jaccard(a: str, b: str, n: int = 5) -> float:
    def grams(t):
        w = t.split()
        return {tuple(w[i:i + n]) for i in range(len(w))}

    ga, gb = grams(a), grams(b)
    return len(ga & gb) / len(ga | gb)


def test_exact_dedup_normalizes_case_and_spaces():
    texts = ["Hello  World", "hello world", " HELLO world\n", "hello, world", "other"]
    assert exact_keep(texts) == [0, 3, 4]


def test_near_dedup_removes_near_copies_and_keeps_distinct_docs():
    docs = _docs(300)
    r = random.Random(1)
    copies = []
    for d in docs[:40]:  # one word changed: 5-gram Jaccard around 0.9
        w = d.split()
        w[r.randrange(len(w))] = "CHANGED"
        copies.append(" ".join(w))
    texts = docs + copies
    keep = near_keep(texts, threshold=0.7, num_perm=128, ngram=5)
    removed = sorted(set(range(len(texts))) - set(keep))
    assert all(_jaccard(texts[i], texts[i - 300]) > 0.7 for i in range(300, 340))
    assert removed == list(range(300, 340))  # every copy, and no original (the first of a pair wins)


def test_minhash_estimates_jaccard():
    a = _docs(1, seed=3)[0]
    w = a.split()
    b = " ".join(w[: len(w) // 2] + _docs(1, seed=4)[0].split()[: len(w) // 2])
    sig, _ = signatures([a, b], num_perm=256, ngram=5)
    estimate = float((sig[0] == sig[1]).mean())
    assert abs(estimate - _jaccard(a, b)) < 0.1


def test_signatures_are_deterministic_and_band_choice_tracks_threshold():
    docs = _docs(20)
    assert np.array_equal(signatures(docs, 64, 5)[0], signatures(docs, 64, 5)[0])
    for t in (0.5, 0.8, 0.9):
        b, r = bands_for(128, t)
        assert b * r <= 128 and abs((1 / b) ** (1 / r) - t) < 0.05
