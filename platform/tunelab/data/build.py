"""data.build(cfg.data, tokenizer, cache_dir) -> tokenized, label-masked (optionally packed) train/validation
sets, cached under cache_dir/data/<fingerprint>/ with their stats.

Order of the stages: read sources -> formats -> empty-reply filter -> dedup (exact, near) -> template +
tokenize (token filters, truncation) -> train/validation split by seed -> source weights (train only) ->
packing (train only; validation stays one example per row, so validation loss and evals see examples).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
from datasets import Dataset, DatasetDict, load_from_disk

from tunelab.core.config import DataCfg
from tunelab.core.errors import UserError
from tunelab.core.files import atomic_dir
from tunelab.data.collect import Collected, collect
from tunelab.data.pack import pack
from tunelab.data.recipe import Recipe, load_recipe
from tunelab.data.sources import source_fingerprint
from tunelab.data.templates import TEMPLATES
from tunelab.data.tokenize import IGNORE, ExampleError, Settings, Tokenized, tokenize

Progress = Callable[[int, int], None]  # (examples done, total)

__all__ = ["IGNORE", "Built", "build", "build_info", "fingerprint"]

BUILD_VERSION = "2"  # bump when the output of a build changes, so old caches are not reused


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps([tokenizer.special_tokens_map, getattr(tokenizer, "chat_template", None),
                        type(tokenizer).__name__], sort_keys=True, default=str)
    return hashlib.sha256((body + extra).encode()).hexdigest()[:16]


def template_name(cfg: DataCfg, recipe: Recipe) -> str:
    return cfg.template or recipe.template


def fingerprint(cfg: DataCfg, recipe: Recipe, recipe_path: Path, tokenizer) -> str:
    """Everything a build's output depends on; cells that share it share the cached dataset."""
    parts = {
        "v": BUILD_VERSION,
        "recipe": recipe.model_dump(mode="json"),
        "sources": [source_fingerprint(s, recipe_path) for s in recipe.sources],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "template": template_name(cfg, recipe),
        "data": cfg.model_dump(mode="json", exclude={"recipe", "template"}),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Built:
    datasets: DatasetDict
    stats: dict
    path: Path
    cached: bool


def build(cfg: DataCfg, tokenizer: Any, cache_dir: Path | str, *, num_proc: int | None = None,
          progress: Progress | None = None) -> DatasetDict:
    return build_info(cfg, tokenizer, cache_dir, num_proc=num_proc, progress=progress).datasets


def build_info(cfg: DataCfg, tokenizer: Any, cache_dir: Path | str, *, num_proc: int | None = None,
               progress: Progress | None = None) -> Built:
    """`progress(done, total)`: examples tokenized so far (a cache hit reports nothing)."""
    recipe, recipe_path = load_recipe(cfg.recipe)
    target = Path(cache_dir) / "data" / fingerprint(cfg, recipe, recipe_path, tokenizer)
    if (target / "stats.json").is_file():
        return Built(load_from_disk(str(target)), json.loads((target / "stats.json").read_text()), target, True)
    t0 = time.perf_counter()
    ds, stats = make(cfg, recipe, recipe_path, tokenizer, num_proc, progress)
    stats.update(fingerprint=target.name, build_seconds=round(time.perf_counter() - t0, 3))
    _save(ds, stats, target)
    return Built(load_from_disk(str(target)), stats, target, False)


def _save(ds: DatasetDict, stats: dict, target: Path) -> None:
    """A cache entry appears whole or not at all (store.atomic_dir); stats.json, written last, marks it."""
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with atomic_dir(target) as tmp:
            ds.save_to_disk(str(tmp))
            (tmp / "stats.json").write_text(json.dumps(stats, indent=1))
    finally:
        if bars:
            datasets.enable_progress_bars()


def make(cfg: DataCfg, recipe: Recipe, recipe_path: Path, tokenizer, num_proc: int | None = None, progress=None):
    """The build itself, uncached: -> (DatasetDict, stats)."""
    got = collect(recipe, recipe_path)
    settings = Settings(TEMPLATES[template_name(cfg, recipe)].load(), cfg.max_length, cfg.train_on_prompt,
                        cfg.truncation, recipe.filters.min_tokens, recipe.filters.max_tokens)
    try:
        ex = tokenize(got.convs, got.sources, tokenizer, settings, num_proc, progress)
    except ExampleError as e:
        s, row = got.origins[e.index]
        raise UserError(f"{recipe.sources[s].label(s)}: row {row}: {e.message}", file=recipe_path,
                        key="template") from None
    _check_sources(got, ex, recipe_path)
    train_idx, val_idx = split(len(ex), recipe.val_size, recipe.seed, recipe_path)
    train, val = ex.take(weighted(train_idx, ex.source, recipe)), ex.take(val_idx)
    _count(got, train, val, ex.source[train_idx])
    packed = pack(train, cfg.max_length) if cfg.pack else None
    ds = DatasetDict({"train": _packed_dataset(packed) if packed else _dataset(train), "validation": _dataset(val)})
    return ds, _stats(cfg, recipe, recipe_path, got, ex, train, packed)


def _check_sources(got: Collected, ex: Tokenized, recipe_path: Path) -> None:
    counts = np.bincount(ex.source, minlength=len(got.stats))
    for (s, reason), n in sorted(ex.dropped.items()):
        got.stats[s].dropped[reason] = n
    for s, st in enumerate(got.stats):
        st.examples = int(counts[s])
        if st.examples == 0:
            steps = {k: v for k, v in asdict(st).items() if k in ("read", "empty_response", "duplicates_exact",
                                                                  "duplicates_near") and v}
            raise UserError(f"{st.label} yields no examples after filtering ({steps}, dropped while tokenizing: "
                            f"{st.dropped or 'none'}); check its file, 'fields', the recipe's 'filters' and the "
                            f"cell's max_length", file=recipe_path, key=f"sources[{s}]")


def split(n: int, val_size: float, seed: int, recipe_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic by seed: a seeded permutation; the first n_val examples are validation."""
    n_val = int(val_size) if val_size >= 1 else max(1, round(n * val_size))
    if n_val >= n:
        raise UserError(f"val_size {val_size} takes {n_val} of the {n} examples and leaves none for training",
                        file=recipe_path, key="val_size")
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def weighted(train_idx: np.ndarray, sources: np.ndarray, recipe: Recipe) -> np.ndarray:
    """Each source's training rows times its weight: whole copies, then a seeded sample for the fraction."""
    if all(s.weight == 1 for s in recipe.sources):
        return train_idx
    rng = np.random.default_rng(recipe.seed + 1)
    parts = []
    for s, src in enumerate(recipe.sources):
        own = train_idx[sources[train_idx] == s]
        whole, frac = divmod(src.weight, 1)
        parts += [own] * int(whole)
        parts.append(np.sort(rng.choice(own, int(round(frac * len(own))), replace=False)))
    return np.concatenate(parts)


def _count(got: Collected, train: Tokenized, val: Tokenized, unique_train_sources: np.ndarray) -> None:
    n = len(got.stats)
    for s, (tr, tw, va) in enumerate(zip(np.bincount(unique_train_sources, minlength=n),
                                         np.bincount(train.source, minlength=n),
                                         np.bincount(val.source, minlength=n))):
        got.stats[s].train, got.stats[s].train_weighted, got.stats[s].validation = int(tr), int(tw), int(va)


def _list_column(values: np.ndarray, offsets: np.ndarray) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))


def _dataset(ex: Tokenized) -> Dataset:
    return Dataset(pa.table({"input_ids": _list_column(ex.ids, ex.offsets),
                             "labels": _list_column(ex.labels, ex.offsets),
                             "source": pa.array(ex.source)}))


def _packed_dataset(p) -> Dataset:
    return Dataset(pa.table({"input_ids": _list_column(p.ids, p.offsets),
                             "labels": _list_column(p.labels, p.offsets),
                             "position_ids": _list_column(p.position_ids, p.offsets)}))


def _stats(cfg: DataCfg, recipe: Recipe, recipe_path: Path, got: Collected, ex: Tokenized, train: Tokenized,
           packed: Any) -> dict:
    q = [50, 90, 95, 99]
    lengths = ex.length
    stats = {
        "recipe": str(recipe_path), "template": template_name(cfg, recipe), "max_length": cfg.max_length,
        "truncation": cfg.truncation, "train_on_prompt": cfg.train_on_prompt, "pack": cfg.pack,
        "sources": [asdict(s) for s in got.stats],
        "examples": len(ex),
        "duplicates_removed": {"exact": sum(s.duplicates_exact for s in got.stats),
                               "near": sum(s.duplicates_near for s in got.stats)},
        "tokens_untruncated": {**{f"p{p}": float(np.percentile(lengths, p)) for p in q},
                               "mean": float(lengths.mean()), "max": int(lengths.max())},
        "truncated": int(ex.truncated.sum()), "truncated_share": float(ex.truncated.mean()),
        "train_tokens": int(train.offsets[-1]),
        "trained_tokens": int((train.labels != IGNORE).sum()),
        "rows": {"train": len(packed) if packed else len(train),
                 "validation": int(sum(s.validation for s in got.stats))},
    }
    if packed is not None:
        stats["packing"] = {"examples": len(train), "rows": len(packed),
                            "fill": float(packed.offsets[-1] / (len(packed) * cfg.max_length))}
    return stats
