"""Where a benchmark's data comes from: a local folder, the Hugging Face hub, or the offline cache.

Local folders (`eval.data_dir`, `$TUNELAB_EVAL_DATA`, and the cache that `exp eval pull` fills) share
one layout, the hub datasets' own schema as JSON lines:

    <root>/<benchmark>/<subset>/<split>.jsonl      e.g. mmlu/anatomy/test.jsonl, gsm8k/main/test.jsonl

Task YAMLs in tasks/ load through `load` (their `custom_dataset`), which reads what the engine
decided (`Choice`) from the task metadata: so the task definitions stay the same whatever the source.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tunelab.core.files import read_json
from tunelab.evals.testsets import exemplars
from tunelab.evals.testsets.files import cache_root, read_jsonl, write_jsonl  # noqa: F401 - used by task YAMLs' loaders
from tunelab.evals.testsets.pull import pull_mmlu

ENV = "TUNELAB_EVAL_DATA"


def user_root(data_dir: str | None) -> Path | None:
    value = data_dir or os.environ.get(ENV)
    return Path(value).expanduser() if value else None


@dataclass(frozen=True)
class Choice:
    """The engine's decision for one benchmark: `root` is a local folder, or None for the hub."""

    status: str  # "ok" | "unavailable"
    source: str  # "local:<dir>" | "hub:<repo>" | ""
    root: Path | None = None
    reason: str = ""


@functools.cache
def hub_reachable(repo: str) -> bool:
    from tunelab.core import hub_access

    hub_access.prepare_hub()  # bounded requests; offline at once when the hub does not answer
    if os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True") or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return False
    try:
        from huggingface_hub import HfApi

        HfApi().dataset_info(repo, timeout=10)
        return True
    except Exception:  # noqa: BLE001 - unreachable, unknown or gated: all mean "not from the hub"
        return False


def origin(root: Path, local: str) -> str:
    """Where a pulled test set came from (its SOURCE.json, written by `exp eval pull`), for data_source."""
    src = read_json(root / local / "SOURCE.json", dict)
    if not src:
        return ""
    return f" ({src['origin']}; sha256 {src['sha256'][:16]}...; {src['questions']} questions)"


def missing(root: Path, local: str, subsets: list[str], split: str) -> list[Path]:
    return [p for s in subsets if not (p := root / local / s / f"{split}.jsonl").is_file()]


def choose(local: str, hub: str, subsets: list[str], data_dir: str | None, offline_hint: str) -> Choice:
    """A user folder if one is set (it must hold every test file), else the hub, else the cache."""
    user = user_root(data_dir)
    if user is not None:
        gone = missing(user, local, subsets, "test")
        if gone:
            return Choice("unavailable", "", None, f"{len(gone)} test file(s) missing under the data folder "
                          f"{user} (eval.data_dir or ${ENV}), e.g. {gone[0]}")
        return Choice("ok", f"local:{user}{origin(user, local)}", user)
    if hub_reachable(hub):
        return Choice("ok", f"hub:{hub}", None)
    cached = cache_root()
    unchecked = not (cached / local / "SOURCE.json").is_file()  # pulled before sources were checked: again
    if (missing(cached, local, subsets, "test") or unchecked) and local in AUTO_PULL:
        try:  # what `exp eval pull` would fetch, fetched on first need
            AUTO_PULL[local](cached)
        except Exception as e:  # noqa: BLE001 - reported as the reason it is unavailable
            return Choice("unavailable", "", None, f"the hub ({hub}) is unreachable and `exp eval pull` failed: {e}")
    if not missing(cached, local, subsets, "test"):
        return Choice("ok", f"local:{cached}{origin(cached, local)}", cached)
    return Choice("unavailable", "", None, f"the hub ({hub}) is unreachable and no local copy exists: "
                  f"{offline_hint} or put {local}/<subset>/test.jsonl under eval.data_dir / ${ENV}")


AUTO_PULL = {"mmlu": pull_mmlu}  # benchmarks with an offline source


# Splits that may be missing locally and are then taken from the exemplars lm-eval ships.
SHIPPED: dict[tuple[str, str], Callable[[str], tuple[dict, ...]]] = {
    ("mmlu", "dev"): exemplars.mmlu,
    ("gsm8k", "fewshot"): lambda name: exemplars.gsm8k(),
    ("bbh", "fewshot"): exemplars.bbh,
}


def load(hub: str, local: str, splits: list[str], name: str = "main", tunelab_roots: dict | None = None, **_):
    """custom_dataset of the task YAMLs: a DatasetDict with `splits`, from the folder the engine chose for
    this benchmark (metadata `tunelab_roots`), or from the hub when it chose none."""
    import datasets

    root = (tunelab_roots or {}).get(local)
    out = {}
    for split in splits:
        path = Path(root) / local / name / f"{split}.jsonl" if root else None
        if path is not None and path.is_file():
            out[split] = datasets.Dataset.from_list(read_jsonl(path))
        elif (local, split) in SHIPPED and (root or split == "fewshot"):
            out[split] = datasets.Dataset.from_list([dict(r) for r in SHIPPED[(local, split)](name)])
        elif root:
            raise FileNotFoundError(f"{path} is missing")
        else:
            out[split] = datasets.load_dataset(hub, name, split=split)
    return datasets.DatasetDict(out)


def generated_docs(generator: str, n: int, seed: int, held_out: bool = False) -> list[dict]:
    """Items made by a tunelab generator, in the GSM8K schema (question, answer ending in '#### N')."""
    from tunelab.data.generators import GENERATORS

    rows = GENERATORS[generator].load()(n=n, seed=seed, **({"held_out": True} if held_out else {}))
    return [{"question": (r["input"] or r["instruction"]),
             "answer": f"{r['output']}\n#### {r['output'].rsplit('The answer is ', 1)[1].rstrip('.')}"}
            for r in rows]


def load_generated(generator: str, n: int, seed: int, held_out: bool = False, **_):
    """custom_dataset of the smoke tasks: held-out items of a tunelab generator, in the GSM8K schema."""
    import datasets

    docs = generated_docs(generator, n, seed, held_out)
    shots = [dict(r) for r in SHIPPED[("gsm8k", "fewshot")]("main")]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs),
                                 "fewshot": datasets.Dataset.from_list(shots)})


def load_exemplars(local: str, name: str, **_):
    """custom_dataset of bbh_smoke: the shipped CoT exemplars as test items (answers extracted)."""
    import datasets

    rows = [dict(r) for r in SHIPPED[(local, "fewshot")](name)]
    for r in rows:
        r["answer"] = r["target"].rsplit("the answer is ", 1)[-1].rstrip(".").strip()
    return datasets.DatasetDict({"exemplars": datasets.Dataset.from_list(rows)})
