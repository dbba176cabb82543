"""Conversations -> token ids and labels, in batches and optionally in worker processes.

Each template segment is tokenized on its own (one batched call for all segments of a chunk), so the
label mask falls exactly on segment boundaries: assistant segments (and the EOS after them) keep their
ids as labels, everything else gets IGNORE unless `train_on_prompt`.

Truncation policy (`truncation`):
  cut   keep the first `max_length` tokens; an example with no assistant token left is dropped
  drop  drop every example longer than `max_length`
Filters `min_tokens` / `max_tokens` look at the untruncated length and drop what falls outside.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from array import array
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tunelab.core.errors import env_number
from tunelab.data.templates import Template, TemplateError

IGNORE = -100


class ExampleError(ValueError):
    """A template failed on one example; `index` is the example's position in the input list."""

    def __init__(self, index: int, message: str):
        super().__init__(index, message)
        self.index, self.message = index, message


@dataclass
class Settings:
    template: Template
    max_length: int
    train_on_prompt: bool
    truncation: str
    min_tokens: int | None = None
    max_tokens: int | None = None


@dataclass
class Tokenized:
    """Examples as flat arrays: example i is ids[offsets[i]:offsets[i+1]]."""

    ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    source: np.ndarray      # source index of each example
    length: np.ndarray      # untruncated length
    truncated: np.ndarray   # bool
    dropped: Counter = field(default_factory=Counter)  # (source, reason) -> count

    def __len__(self) -> int:
        return len(self.source)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def take(self, index: np.ndarray) -> Tokenized:
        """The examples at `index`, in that order (repeats allowed)."""
        index = np.asarray(index, dtype=np.int64)
        starts, lens = self.offsets[:-1][index], self.lengths()[index]
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        gather = np.repeat(starts - offsets[:-1], lens) + np.arange(offsets[-1])
        return Tokenized(self.ids[gather], self.labels[gather], offsets, self.source[index], self.length[index],
                         self.truncated[index], Counter(self.dropped))

    @staticmethod
    def concat(parts: list[Tokenized]) -> Tokenized:
        sizes = [p.offsets[-1] for p in parts]
        shift: Any = np.concatenate([[0], np.cumsum(sizes)[:-1]]) if parts else []
        offsets = np.concatenate([[0]] + [p.offsets[1:] + s for p, s in zip(parts, shift)]).astype(np.int64)
        dropped = sum((p.dropped for p in parts), Counter())

        def cat(name: str, dt) -> np.ndarray:
            return np.concatenate([getattr(p, name) for p in parts]).astype(dt) if parts else np.zeros(0, dt)

        return Tokenized(cat("ids", np.int32), cat("labels", np.int32), offsets, cat("source", np.int32),
                         cat("length", np.int32), cat("truncated", bool), dropped)


def special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before a text when asked for special tokens (BOS for Llama, none for GPT-2)."""
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    n = len(with_special) - len(plain)
    return with_special[:n] if n > 0 and with_special[n:n + len(plain)] == plain else []


def encoder(tokenizer):
    """texts -> list of id lists, without special tokens: the Rust batch encoder when there is one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        return lambda texts: [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    return lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]


def _segments(convs: list[list[dict]], tokenizer, template: Template, base: int) -> list:
    out = []
    for i, conv in enumerate(convs):
        try:
            out.append(template.segments(conv, tokenizer))
        except TemplateError as e:
            raise ExampleError(base + i, str(e)) from None
    return out


def tokenize_chunk(convs: list[list[dict]], sources: list[int], tokenizer, s: Settings, base: int = 0) -> Tokenized:
    segs = _segments(convs, tokenizer, s.template, base)
    encoded = encoder(tokenizer)([seg.text for row in segs for seg in row])
    prefix = special_prefix(tokenizer) if s.template.add_special_tokens else []
    eos = tokenizer.eos_token_id
    ids, labels, offsets = array("i"), array("i"), [0]
    src, length, truncated = [], [], []
    dropped: Counter[tuple[int, str]] = Counter()
    k = 0
    for row, source in zip(segs, sources):
        ex_ids, ex_labels, first_trained = list(prefix), [IGNORE] * len(prefix), None
        for seg in row:
            toks = encoded[k]
            k += 1
            if seg.eos and eos is not None:
                toks = toks + [eos]
            if seg.trained and toks and first_trained is None:
                first_trained = len(ex_ids)
            ex_ids += toks
            ex_labels += toks if seg.trained else [IGNORE] * len(toks)
        n = len(ex_ids)
        reason = None
        if first_trained is None:
            reason = "no_response_tokens"
        elif s.min_tokens is not None and n < s.min_tokens:
            reason = "below_min_tokens"
        elif s.max_tokens is not None and n > s.max_tokens:
            reason = "above_max_tokens"
        elif n > s.max_length and s.truncation == "drop":
            reason = "over_max_length"
        elif first_trained >= s.max_length:
            reason = "no_response_after_truncation"
        if reason:
            dropped[(source, reason)] += 1
            continue
        keep = min(n, s.max_length)
        ids.extend(ex_ids[:keep])
        labels.extend(ex_ids[:keep] if s.train_on_prompt else ex_labels[:keep])
        offsets.append(offsets[-1] + keep)
        src.append(source)
        length.append(n)
        truncated.append(n > s.max_length)
    return Tokenized(np.frombuffer(ids, dtype=np.int32).copy(), np.frombuffer(labels, dtype=np.int32).copy(),
                     np.asarray(offsets, dtype=np.int64), np.asarray(src, dtype=np.int32),
                     np.asarray(length, dtype=np.int32), np.asarray(truncated, dtype=bool), dropped)


NUM_PROC_ENV = "TUNELAB_NUM_PROC"
CHUNK = 2000  # examples per batched encoder call (and per task for a worker)
_WORK: dict[str, tuple] = {}  # "job": (convs, sources, tokenizer, settings), inherited by forked workers


def _work(bounds: tuple[int, int]) -> Tokenized:
    convs, sources, tokenizer, settings = _WORK["job"]
    lo, hi = bounds
    return tokenize_chunk(convs[lo:hi], sources[lo:hi], tokenizer, settings, lo)


def num_proc_env() -> int | None:
    """$TUNELAB_NUM_PROC: the tokenizer's worker processes, set by the user (None: unset)."""
    return int(env_number(NUM_PROC_ENV, 0, least=1, strict=False, whole=True,
                          unset="sized to the examples and the CPUs")) or None


def auto_num_proc(n: int) -> int:
    """The Rust encoder already spreads one batch over every core; worker processes add the Python side
    of the work in parallel, which pays from a few thousand examples on and only with cores to spare
    (on 2 shared cores, 2 workers measured slower than 1: benchmarks/README.md)."""
    env = num_proc_env()
    if env:
        return env
    cpus = os.cpu_count() or 1
    return 1 if n < 8000 or cpus < 4 else min(8, cpus // 2)


def tokenize(convs: list[list[dict]], sources: list[int], tokenizer, settings: Settings,
             num_proc: int | None = None, progress: Callable[[int, int], None] | None = None) -> Tokenized:
    """All examples, in order. With num_proc > 1 the chunks go to forked workers, which inherit the
    tokenizer instead of pickling it; each runs the Rust encoder on one thread. `progress(done, total)` is
    called after each chunk."""
    num_proc = auto_num_proc(len(convs)) if num_proc is None else num_proc
    bounds = [(lo, min(lo + CHUNK, len(convs))) for lo in range(0, len(convs), CHUNK)]

    def collect(chunks) -> Tokenized:
        done = []
        for (_, b), chunk in zip(bounds, chunks):
            done.append(chunk)
            if progress:
                progress(b, len(convs))
        return Tokenized.concat(done)

    if num_proc <= 1 or len(bounds) <= 1 or "fork" not in mp.get_all_start_methods():
        return collect(tokenize_chunk(convs[a:b], sources[a:b], tokenizer, settings, a) for a, b in bounds)
    _WORK["job"] = (convs, sources, tokenizer, settings)
    try:
        with ProcessPoolExecutor(num_proc, mp_context=mp.get_context("fork"),
                                 initializer=os.environ.__setitem__,
                                 initargs=("TOKENIZERS_PARALLELISM", "false")) as pool:
            return collect(pool.map(_work, bounds))
    finally:
        _WORK.clear()
