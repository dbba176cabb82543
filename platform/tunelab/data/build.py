"""data.build(cfg.data, tokenizer, cache_dir) -> tokenized, label-masked train/validation sets, cached."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from datasets import Dataset, DatasetDict, load_from_disk

from tunelab.data.recipe import load_recipe, read_source, source_fingerprint
from tunelab.data.templates import TEMPLATES

IGNORE = -100
BUILD_VERSION = "1"  # bump when tokenization changes, so old caches are not reused


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else repr(tokenizer.get_vocab())
    specials = json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str)
    return hashlib.sha256((body + specials + type(tokenizer).__name__).encode()).hexdigest()[:16]


def fingerprint(cfg, recipe, recipe_path: Path, tokenizer) -> str:
    parts = {
        "v": BUILD_VERSION,
        "recipe": recipe.model_dump(mode="json"),
        "sources": [source_fingerprint(s, recipe_path) for s in recipe.sources],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_length": cfg.max_length,
        "template": cfg.template or recipe.template,
        "train_on_prompt": cfg.train_on_prompt,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def split(rows: list[dict], val_size: float, seed: int) -> tuple[list[dict], list[dict]]:
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_val = int(val_size) if val_size >= 1 else max(1, round(len(rows) * val_size))
    val = sorted(order[:n_val])
    train = sorted(order[n_val:])
    return [rows[i] for i in train], [rows[i] for i in val]


def tokenize_fn(tokenizer, template, max_length: int, train_on_prompt: bool):
    """Prompt and response are tokenized apart so the label mask falls exactly on the boundary.
    Truncation keeps the whole prompt and cuts the response from the right (dropping EOS);
    an example whose prompt leaves no room for a response token is dropped."""
    eos = tokenizer.eos_token_id

    def fn(batch: dict) -> dict:
        rows = [dict(zip(batch, vals)) for vals in zip(*batch.values())]
        pairs = [template.render(r, tokenizer) for r in rows]
        prompts = tokenizer([p for p, _ in pairs], add_special_tokens=True)["input_ids"]
        responses = tokenizer([r for _, r in pairs], add_special_tokens=False)["input_ids"]
        out = {"input_ids": [], "labels": []}
        for p, r in zip(prompts, responses):
            if len(p) >= max_length:
                continue
            ids = (p + r + [eos])[:max_length]
            labels = ids.copy() if train_on_prompt else [IGNORE] * len(p) + ids[len(p):]
            out["input_ids"].append(ids)
            out["labels"].append(labels)
        return out

    return fn


def build(cfg, tokenizer, cache_dir: Path | str) -> DatasetDict:
    recipe, recipe_path = load_recipe(cfg.recipe)
    target = Path(cache_dir) / "data" / fingerprint(cfg, recipe, recipe_path, tokenizer)
    if target.is_dir():
        return load_from_disk(str(target))
    rows = [row for i, s in enumerate(recipe.sources) for row in read_source(s, recipe_path, i)]
    train, val = split(rows, recipe.val_size, recipe.seed)
    fn = tokenize_fn(tokenizer, TEMPLATES[cfg.template or recipe.template], cfg.max_length, cfg.train_on_prompt)
    cols = ["instruction", "input", "output"]
    ds = DatasetDict({
        name: Dataset.from_list(part).map(fn, batched=True, remove_columns=cols)
        for name, part in (("train", train), ("validation", val))
    })
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
    ds.save_to_disk(str(tmp / "ds"))
    try:
        os.replace(tmp / "ds", target)
    except OSError:  # another process built the same fingerprint first
        pass
    shutil.rmtree(tmp, ignore_errors=True)
    return load_from_disk(str(target))
