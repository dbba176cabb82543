"""A small local lm-eval task folder (eval.include_path), built by the tests: one task per request type, a
sampling task the engine leaves to lm-eval's `hf` code, and groups aggregated with and without weights."""

from __future__ import annotations

import json
import random
from pathlib import Path

MC = [("The sky is", ["blue", "green", "loud", "seven"], 0), ("Two plus two is", ["three", "four", "a cat", "red"], 1),
      ("Water is", ["dry", "wet", "square", "late"], 1), ("Fire is", ["cold", "hot", "blue", "quiet"], 1),
      ("A dog says", ["moo", "woof", "tweet", "meow"], 1)]
GEN = [("What is 2 + 3?", "5"), ("What is 7 - 4?", "3"), ("What is 3 * 3?", "9"), ("Name a colour.", "red")]
METRIC = "  - {{metric: {}, aggregation: mean, higher_is_better: true{}}}\n"


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _task(folder: Path, name: str, body: str, files: dict[str, str]) -> None:
    data = ", ".join(f"{split}: {path}" for split, path in files.items())
    (folder / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs: {{data_files: {{{data}}}}}"
                                         f"\ntest_split: test\n{body}metadata: {{version: 1.0}}\n")


def build(folder: Path) -> Path:
    """Write the task folder and its data; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    mc = [{"question": q, "choices": c, "label": a} for q, c, a in MC]
    multiple_choice = ("output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
                       "doc_to_target: label\ndoc_to_choice: choices\nmetric_list:\n"
                       + METRIC.format("acc", "") + METRIC.format("acc_norm", ""))
    _task(folder, "tl_mc", multiple_choice, {"test": _jsonl(folder / "mc.jsonl", mc)})
    _task(folder, "tl_mc2", multiple_choice, {"test": _jsonl(folder / "mc2.jsonl", mc[:3])})
    gen = _jsonl(folder / "gen.jsonl", [{"question": q, "answer": a} for q, a in GEN])
    generation = ("fewshot_split: train\nnum_fewshot: 2\noutput_type: generate_until\ndoc_to_text: \"Q: {{question}}"
                  "\\nA:\"\ndoc_to_target: \"{{answer}}\"\ngeneration_kwargs: {until: [\"\\n\", \"Q:\"], "
                  "do_sample: false, max_gen_toks: 16}\nfilter_list:\n  - name: first-word\n    filter:\n"
                  "      - {function: regex, regex_pattern: \"(\\\\w+)\"}\n      - {function: take_first}\n"
                  "metric_list:\n" + METRIC.format("exact_match", ", ignore_case: true"))
    _task(folder, "tl_gen", generation, {"test": gen, "train": gen})
    _task(folder, "tl_sample", generation.replace("do_sample: false", "do_sample: true, temperature: 1.0"),
          {"test": gen, "train": gen})
    rng = random.Random(0)
    words = "the of and a to in is was that for on with as by at from his her an which are be this".split()
    texts = [{"text": " ".join(rng.choice(words) for _ in range(n)) + "."} for n in (40, 260, 700)]
    _task(folder, "tl_ppl", "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
          "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
          {"test": _jsonl(folder / "ppl.jsonl", texts)})
    (folder / "tl_group.yaml").write_text(
        "group: tl_group\ntask: [tl_mc, tl_mc2]\naggregate_metric_list:\n  - {metric: acc, weight_by_size: true}\n"
        "  - {metric: acc_norm, weight_by_size: false}\nmetadata: {version: 1.0}\n")
    return folder


IFEVAL = [  # google/IFEval's schema; each instruction is checked by lm-eval's rule checker
    {"key": 1, "prompt": "Write a short note about the sea. Do not use any commas.",
     "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]},
    {"key": 2, "prompt": "Describe a cat in at least 2 sentences, all in English capital letters.",
     "instruction_id_list": ["length_constraints:number_sentences", "change_case:english_capital"],
     "kwargs": [{"relation": "at least", "num_sentences": 2}, {}]},
    {"key": 3, "prompt": "List three fruits. Use at least 2 words in all capital letters.",
     "instruction_id_list": ["change_case:capital_word_frequency"],
     "kwargs": [{"capital_relation": "at least", "capital_frequency": 2}]},
]


def ifeval_data(root: Path) -> Path:
    """An eval.data_dir holding a few IFEval prompts where lm-eval's ifeval reads them: <dir>/ifeval/train.jsonl."""
    (root / "ifeval").mkdir(parents=True, exist_ok=True)
    _jsonl(root / "ifeval" / "train.jsonl", IFEVAL)
    return root
