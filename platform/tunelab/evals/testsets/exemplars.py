"""The few-shot exemplars that lm-eval ships inside its task YAMLs, read from the installed package.

They are the literature's prompts (GSM8K: the 8 chain-of-thought exemplars of Wei et al.; BBH: the 3
CoT exemplars per task of Suzgun et al.; MMLU: the Flan CoT prompts, which are the MMLU dev questions).
Reading them from the installed lm-eval keeps tunelab's prompts identical to lm-eval's built-in tasks.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import yaml

MMLU_LETTERS = "ABCD"


def lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def _samples(relpath: str) -> list[dict]:
    cfg = yaml.safe_load((lm_eval_tasks_dir() / relpath).read_text())
    return list(cfg["fewshot_config"]["samples"])


@functools.cache
def gsm8k() -> tuple[dict, ...]:
    """{question, target}: the 8-shot CoT exemplars of lm-eval's gsm8k_cot."""
    return tuple(_samples("gsm8k/gsm8k-cot.yaml"))


@functools.cache
def bbh(task: str) -> tuple[dict, ...]:
    """{input, target}: the 3 CoT exemplars of one BBH task, as in lm-eval's bbh_cot_fewshot."""
    return tuple(_samples(f"bbh/cot_fewshot/{task}.yaml"))


def bbh_description(task: str) -> str:
    return yaml.safe_load((lm_eval_tasks_dir() / f"bbh/cot_fewshot/{task}.yaml").read_text())["description"]


def bbh_tasks() -> list[str]:
    return sorted(p.stem for p in (lm_eval_tasks_dir() / "bbh/cot_fewshot").glob("[!_]*.yaml"))


_CHOICES = re.compile(r"^(.*?)\s\(A\) (.*?)\s\(B\) (.*?)\s\(C\) (.*?)\s\(D\) (.*)$", re.S)
_ANSWER = re.compile(r"answer is \(([A-E])\)")


@functools.cache
def mmlu(subject: str) -> tuple[dict, ...]:
    """The MMLU dev questions of one subject in the hub schema {question, subject, choices, answer},
    recovered from the Flan CoT exemplars lm-eval ships (mmlu/flan_cot_fewshot): the question text
    holds the choices as "(A) .. (D) ..", the CoT target ends in "The answer is (X)". Exemplars with
    a fifth option (one in college_chemistry) cannot be a 4-choice question and are left out."""
    rows = []
    for s in _samples(f"mmlu/flan_cot_fewshot/mmlu_{subject}.yaml"):
        m, answers = _CHOICES.match(s["question"].strip()), _ANSWER.findall(s["target"])
        if not m or not answers or answers[-1] not in MMLU_LETTERS or "\n(E) " in s["question"]:
            continue
        question, *choices = (g.strip() for g in m.groups())
        rows.append({"question": question, "subject": subject, "choices": choices,
                     "answer": MMLU_LETTERS.index(answers[-1])})
    return tuple(rows)


def mmlu_subjects() -> list[str]:
    """The 57 subjects with their category (stem, humanities, social_sciences, other) as lm-eval groups them."""
    return sorted(p.stem.removeprefix("mmlu_") for p in (lm_eval_tasks_dir() / "mmlu/default").glob("mmlu_*.yaml"))


def mmlu_category(subject: str) -> str:
    tag = yaml.safe_load((lm_eval_tasks_dir() / f"mmlu/default/mmlu_{subject}.yaml").read_text())["tag"]
    return tag.removeprefix("mmlu_").removesuffix("_tasks")
