"""Deduplication: exact (on normalized text) and near-duplicate (MinHash + LSH banding), first row wins.

MinHash is written with numpy rather than taken from a package: shingles are word n-grams hashed with
fixed random multipliers, and each permutation is a multiply-shift hash, so signatures are the same
on every machine and in every process (Python's own `hash` of strings is salted per process).
"""

from __future__ import annotations

import re

import numpy as np

WORD = re.compile(r"\w+")
MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


def conversation_text(conv: list[dict]) -> str:
    """The text that identifies an example: every turn's role and content (and Alpaca input)."""
    return "\x1f".join(f"{t['role']}\x1e{t['content']}\x1e{t.get('input', '')}" for t in conv)


def exact_keep(texts: list[str]) -> list[int]:
    """Indices of the first occurrence of each normalized text."""
    seen: set[str] = set()
    keep = []
    for i, t in enumerate(texts):
        key = normalize(t)
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return keep


def _word_ids(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    vocab: dict[str, int] = {}
    flat: list[int] = []
    lengths: list[int] = []
    for t in texts:
        words = WORD.findall(t.lower())
        flat.extend(vocab.setdefault(w, len(vocab) + 1) for w in words)
        lengths.append(len(words))
    return np.asarray(flat, dtype=np.uint64), np.asarray(lengths, dtype=np.int64)


def _shingles(ids: np.ndarray, lengths: np.ndarray, ngram: int, rng: np.random.Generator) -> np.ndarray:
    """One 64-bit hash per word position: the n-gram starting there (shorter at a document's end)."""
    ends = np.repeat(np.cumsum(lengths), lengths)
    pos = np.arange(len(ids))
    padded = np.concatenate([ids, np.zeros(ngram, dtype=np.uint64)])
    mult = rng.integers(1, 2**63, size=ngram, dtype=np.uint64) | np.uint64(1)
    h = np.zeros(len(ids), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(ngram):
            h += np.where(pos + k < ends, padded[k: k + len(ids)] * mult[k], np.uint64(0))
            h = (h ^ (h >> np.uint64(29))) * np.uint64(0xBF58476D1CE4E5B9)  # mix, so order matters
    return h


def signatures(texts: list[str], num_perm: int, ngram: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """MinHash signatures (docs x num_perm, uint32) and a mask of docs that have any words."""
    rng = np.random.default_rng(seed)
    ids, lengths = _word_ids(texts)
    sh = _shingles(ids, lengths, ngram, rng)
    a = rng.integers(1, 2**63, size=num_perm, dtype=np.uint64) | np.uint64(1)
    b = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)
    has = lengths > 0
    sig = np.full((len(texts), num_perm), np.iinfo(np.uint32).max, dtype=np.uint32)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    docs = np.flatnonzero(has)
    chunk = max(1, (1 << 16) // max(1, int(lengths.mean()) if len(lengths) else 1))
    with np.errstate(over="ignore"):
        for lo in range(0, len(docs), chunk):
            d = docs[lo: lo + chunk]
            s0, s1 = starts[d[0]], starts[d[-1]] + lengths[d[-1]]
            hv = sh[s0:s1, None] * a[None, :]
            hv += b[None, :]
            hv >>= np.uint64(32)
            sig[d] = np.minimum.reduceat(hv, starts[d] - s0, axis=0)
    return sig, has


def bands_for(num_perm: int, threshold: float) -> tuple[int, int]:
    """(bands, rows) whose LSH S-curve crosses 1/2 closest to the threshold: (1/b)^(1/r) ~ t."""
    options = [(num_perm // r, r) for r in range(1, num_perm + 1)]
    return min(options, key=lambda br: abs((1 / br[0]) ** (1 / br[1]) - threshold))


class _Union:
    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, i: int, j: int) -> None:
        ri, rj = self.find(i), self.find(j)
        if ri != rj:  # the smaller index stays the root: the first row of a cluster is kept
            self.parent[max(ri, rj)] = min(ri, rj)


def near_keep(texts: list[str], threshold: float, num_perm: int = 128, ngram: int = 5, seed: int = 0) -> list[int]:
    """Indices kept after near-duplicate removal: LSH bands propose pairs, the signature agreement
    (an estimate of Jaccard similarity of the shingle sets) confirms them, clusters keep their first row."""
    n = len(texts)
    if n < 2:
        return list(range(n))
    sig, has = signatures(texts, num_perm, ngram, seed)
    nb, rows = bands_for(num_perm, threshold)
    mult = np.random.default_rng(seed + 1).integers(1, 2**63, size=rows, dtype=np.uint64) | np.uint64(1)
    uf = _Union(n)
    docs = np.flatnonzero(has)
    with np.errstate(over="ignore"):
        for band in range(nb):
            keys = (sig[docs, band * rows:(band + 1) * rows].astype(np.uint64) * mult).sum(axis=1)
            order = np.argsort(keys, kind="stable")
            same = keys[order][1:] == keys[order][:-1]
            if not same.any():
                continue
            starts = np.flatnonzero(np.concatenate([[True], ~same]))
            sizes = np.diff(np.append(starts, len(order)))
            for s, z in zip(starts[sizes > 1], sizes[sizes > 1]):
                members = docs[order[s: s + z]]
                anchor = members.min()
                agree = (sig[members] == sig[anchor]).mean(axis=1)
                for m, sim in zip(members, agree):
                    if m != anchor and sim >= threshold:
                        uf.union(int(anchor), int(m))
    return [i for i in range(n) if uf.find(i) == i]
