"""Dataset build speed, tunelab's data layer vs a plain `datasets.map`: 52,000 Alpaca-shaped records.

    python benchmarks/data_build.py [--records 52000] [--max-length 512] [--model NAME] [--num-proc N]
                                    [--repeats 1] [--out FILE]

The records are generated here (no download) with Alpaca-like lengths: instruction ~13 words, an input on
~40% of rows (~20 words), output ~45 words on average with a long tail (log-normal word counts, the shape
of tatsu-lab/alpaca's), and written to a JSONL file that both sides read.

tunelab:  `build_info` on a recipe pointing at the file (read, exact dedup, Alpaca template, tokenize
          prompt/response segments with masked labels, EOS, truncation, split, save_to_disk), in a fresh
          cache directory; then the same call again, which finds the cache (the "cached rebuild").
baseline: `datasets` as the usual Alpaca preprocessing writes it: `load_dataset("json")` +
          `Dataset.map(batched=True)` (tokenize the prompt and prompt+response, mask the prompt's length, append
          EOS, truncate), then `train_test_split` + `save_to_disk`; with num_proc=1 (the plain call) and with
          the worker processes tunelab uses.
best:     `datasets` at its best for this job (the headline peer): every text tokenized once (prompt and
          response apart, then concatenated), everything kept in memory (keep_in_memory: no Arrow cache files
          between steps) and written once by `save_to_disk`, with tunelab's number of worker processes.
Records/s = records in the file / wall seconds of the whole build. Every figure printed is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

WORDS = ("the of and to a in is that for it as was with be by on not he this are or his from at which but have "
         "an they you were her she there been one all we their has would when if so no what up out about who "
         "into them more some could time these two may then do first any my now such like our over man me even "
         "most made after also did many before must through back years where much your way well down should "
         "because each just those people how too little state good very make world still own see men work long "
         "get here between both life being under never day same another know while last might us great old year "
         "off come since against go came right used take three data model write explain list describe example "
         "function number water energy health plan story poem reason").split()


def lognormal_words(r: random.Random, mean: float, sigma: float, cap: int) -> int:
    mu = __import__("math").log(mean) - sigma * sigma / 2  # so that the mean is `mean`
    return max(1, min(cap, int(r.lognormvariate(mu, sigma))))


def sentence(r: random.Random, n: int) -> str:
    words = [r.choice(WORDS) for _ in range(n)]
    words[0] = words[0].capitalize()
    return " ".join(words) + r.choice([".", ".", "?", "!"])


def alpaca_like(n: int, seed: int = 0) -> list[dict]:
    r = random.Random(seed)
    rows = []
    for _ in range(n):
        rows.append({
            "instruction": sentence(r, lognormal_words(r, 13, 0.5, 80)),
            "input": sentence(r, lognormal_words(r, 20, 0.8, 300)) if r.random() < 0.4 else "",
            "output": sentence(r, lognormal_words(r, 45, 0.9, 700)),
        })
    return rows


def default_model() -> str:
    from tunelab.models import loading

    cached = loading.cache_dir() / "models" / "smollm2-135m-instruct"
    return "smollm2-135m-instruct" if cached.is_dir() else "tiny-random-llama"


def load_tokenizer(name: str):
    from tunelab.cli.data import load_tokenizer as load

    return load(name)


def baseline(path: Path, tokenizer, max_length: int, num_proc: int, work: Path) -> float:
    """The usual Alpaca preprocessing with datasets.map; returns seconds."""
    from datasets import load_dataset

    from tunelab.data.templates import ALPACA_INPUT, ALPACA_NO_INPUT

    eos = tokenizer.eos_token_id

    def preprocess(batch):
        prompts = [(ALPACA_INPUT if inp else ALPACA_NO_INPUT).format(instruction=ins, input=inp)
                   for ins, inp in zip(batch["instruction"], batch["input"])]
        full = [p + o for p, o in zip(prompts, batch["output"])]
        p_ids = tokenizer(prompts)["input_ids"]
        f_ids = tokenizer(full)["input_ids"]
        ids, labels = [], []
        for p, f in zip(p_ids, f_ids):
            x = (f + [eos])[:max_length]
            ids.append(x)
            labels.append(([-100] * len(p) + x[len(p):])[:max_length])
        return {"input_ids": ids, "labels": labels}

    t0 = time.perf_counter()
    ds = load_dataset("json", data_files=str(path), split="train", cache_dir=str(work / "hf"))
    ds = ds.map(preprocess, batched=True, num_proc=num_proc if num_proc > 1 else None,
                remove_columns=ds.column_names)
    ds.train_test_split(test_size=0.02, seed=0).save_to_disk(str(work / "out"))
    return time.perf_counter() - t0


def best(path: Path, tokenizer, max_length: int, num_proc: int, work: Path) -> float:
    """datasets at its best: one tokenization per text, in memory, one write; returns seconds."""
    from datasets import load_dataset

    from tunelab.data.templates import ALPACA_INPUT, ALPACA_NO_INPUT

    eos = tokenizer.eos_token_id

    def preprocess(batch):
        prompts = [(ALPACA_INPUT if inp else ALPACA_NO_INPUT).format(instruction=ins, input=inp)
                   for ins, inp in zip(batch["instruction"], batch["input"])]
        p_ids = tokenizer(prompts)["input_ids"]
        r_ids = tokenizer(batch["output"], add_special_tokens=False)["input_ids"]
        ids, labels = [], []
        for p, r in zip(p_ids, r_ids):
            ids.append((p + r + [eos])[:max_length])
            labels.append(([-100] * len(p) + r + [eos])[:max_length])
        return {"input_ids": ids, "labels": labels}

    t0 = time.perf_counter()
    ds = load_dataset("json", data_files=str(path), split="train", keep_in_memory=True, cache_dir=str(work / "hf"))
    ds = ds.map(preprocess, batched=True, num_proc=num_proc if num_proc > 1 else None, keep_in_memory=True,
                remove_columns=ds.column_names)
    ds.train_test_split(test_size=0.02, seed=0, keep_in_memory=True).save_to_disk(str(work / "out"))
    return time.perf_counter() - t0


def tunelab_build(recipe: Path, tokenizer, max_length: int, num_proc: int, cache: Path) -> tuple[float, float]:
    """(seconds of a fresh build, seconds of the cached rebuild)."""
    from tunelab.core.config import DataCfg
    from tunelab.data.build import build_info

    cfg = DataCfg(recipe=str(recipe), max_length=max_length)
    t0 = time.perf_counter()
    first = build_info(cfg, tokenizer, cache, num_proc=num_proc)
    fresh = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = build_info(cfg, tokenizer, cache, num_proc=num_proc)
    cached = time.perf_counter() - t0
    assert not first.cached and again.cached and len(again.datasets["train"]) == len(first.datasets["train"])
    return fresh, cached


def machine() -> str:
    import psutil

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} logical CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
            f"Python {platform.python_version()}")


def main() -> None:
    import datasets
    import tokenizers
    import transformers

    from tunelab.data.tokenize import auto_num_proc

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=52000)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--model", default=None, help="tokenizer source (default: SmolLM2 if cached, else tiny)")
    ap.add_argument("--num-proc", type=int, default=None, help="tunelab worker processes (default: auto)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each side; the median is reported")
    ap.add_argument("--out", type=Path, default=None, help="also write the figures as JSON")
    args = ap.parse_args()
    datasets.disable_progress_bars()

    model = args.model or default_model()
    tok = load_tokenizer(model)
    num_proc = args.num_proc or auto_num_proc(args.records)
    work = Path(tempfile.mkdtemp(prefix="tunelab-data-bench-"))
    try:
        path = work / "alpaca_like.jsonl"
        rows = alpaca_like(args.records)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        recipe = work / "bench.yaml"
        recipe.write_text(json.dumps({"template": "alpaca", "sources": [{"path": path.name}], "val_size": 0.02}))

        procs = sorted({1, num_proc})
        runs: dict[str, list[float]] = {**{f"baseline_np{n}": [] for n in procs}, f"best_np{num_proc}": [],
                                        "tunelab": [], "tunelab_cached": []}
        for i in range(args.repeats):
            for n in procs:
                runs[f"baseline_np{n}"].append(baseline(path, tok, args.max_length, n, work / f"b{i}-{n}"))
            runs[f"best_np{num_proc}"].append(best(path, tok, args.max_length, num_proc, work / f"best{i}"))
            fresh, cached = tunelab_build(recipe, tok, args.max_length, num_proc, work / f"cache{i}")
            runs["tunelab"].append(fresh)
            runs["tunelab_cached"].append(cached)
        secs = {k: statistics.median(v) for k, v in runs.items()}
        rate = {k: args.records / s for k, s in secs.items() if k != "tunelab_cached"}
        result = {
            "records": args.records, "max_length": args.max_length, "tokenizer": model, "num_proc": num_proc,
            "seconds": secs, "records_per_s": rate,
            "ratio_vs_best": rate["tunelab"] / rate[f"best_np{num_proc}"],
            "ratio_vs_plain_map": rate["tunelab"] / rate["baseline_np1"],
            "ratio_vs_map_same_num_proc": rate["tunelab"] / rate[f"baseline_np{num_proc}"],
            "cached_rebuild_s": secs["tunelab_cached"], "machine": machine(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "versions": {"datasets": datasets.__version__, "transformers": transformers.__version__,
                         "tokenizers": tokenizers.__version__},
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"{args.records} Alpaca-shaped records, max_length {args.max_length}, tokenizer {model}, "
          f"median of {args.repeats}")
    print(f"machine: {result['machine']}")
    for k, r in rate.items():
        print(f"  {k:<22} {secs[k]:7.2f} s  {r:9.0f} records/s")
    print(f"  tunelab / datasets at its best (num_proc={num_proc}):    {result['ratio_vs_best']:.2f}x  (headline)")
    print(f"  tunelab / plain datasets.map (num_proc=1):        {result['ratio_vs_plain_map']:.2f}x")
    print(f"  tunelab / datasets.map with num_proc={num_proc}:           {result['ratio_vs_map_same_num_proc']:.2f}x")
    print(f"  cached rebuild: {secs['tunelab_cached']:.3f} s; load average {result['load_average']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
