"""Helpers for the data-layer tests (imported by tests/test_data_*.py): a tiny tokenizer, recipe files."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import yaml

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@cache
def _trained_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tunelab.data.generators import arithmetic
    from tunelab.data.templates import ALPACA_INPUT, ALPACA_NO_INPUT

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>", "<pad>", "<|im_start|>",
                                                                   "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [r["instruction"] + r["input"] + r["output"] for r in arithmetic(300)]
    bpe.train_from_iterator(corpus + [ALPACA_INPUT, ALPACA_NO_INPUT] * 20, trainer)
    return bpe.to_str()


def tiny_tokenizer(chat: bool = True):
    """A byte-level BPE (any text encodes) with EOS, PAD and, by default, a ChatML chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_trained_bpe()), eos_token="<|endoftext|>",
                                  pad_token="<pad>")
    if chat:
        tok.chat_template = CHATML
    return tok


def write_rows(path: Path, rows: list[dict]) -> Path:
    """Rows into a .json, .jsonl, .parquet or .csv file, by suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".csv":
        import csv

        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return path


def write_recipe(path: Path, **recipe) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def alpaca_rows(n: int, seed: int = 0, prefix: str = "") -> list[dict]:
    """Distinct Alpaca rows (no two alike, so dedup keeps them all)."""
    import random

    r = random.Random(seed)
    words = "apple river stone cloud paper window garden silver music orange table light".split()
    rows = []
    for i in range(n):
        w = " ".join(r.choice(words) for _ in range(r.randint(3, 12)))
        rows.append({"instruction": f"{prefix}Task {i}: describe {w}.", "input": w if i % 3 == 0 else "",
                     "output": f"{prefix}Answer {i}: the {w} is " + " ".join(r.choice(words) for _ in range(8))})
    return rows
