"""Two lm-eval tasks of the kinds users bring, in a local task folder, for `eval_speed.py --task NAME`.

    python benchmarks/lm_task_fixtures.py OUT [--mmlu-dir ~/.cache/tunelab/eval-data] [--gsm8k-dir ../shared/eval-data]

- `fixture_mc` (multiple_choice, ARC's format): MMLU test questions from the offline copy `exp eval pull`
  writes, 0-shot, "Question: ...\\nAnswer:" scored against the four answer texts (acc, acc_norm): four
  log-likelihood requests per question with different continuations, unlike MMLU's shared " A".." D".
- `fixture_gen` (generate_until): GSM8K test problems, 4-shot "Question: ...\\nAnswer:" from the first four,
  greedy until a blank line or "Question:", the last number taken by a regex filter (exact_match).

Both name their files in their YAML (dataset_path: json), so tunelab (`eval.include_path: OUT`) and lm-eval
(`--include_path OUT`) run the same definition on the same items.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MC = """task: fixture_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: {test}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: answer
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
  - {{metric: acc_norm, aggregation: mean, higher_is_better: true}}
metadata: {{version: 1.0}}
"""

GEN = """task: fixture_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {test}, train: {shots}}}}}
test_split: test
fewshot_split: train
num_fewshot: 4
fewshot_config: {{sampler: first_n}}
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer.split('####')[-1].strip()}}}}"
target_delimiter: " "
generation_kwargs: {{until: ["\\n\\n", "Question:"], do_sample: false, max_gen_toks: 256}}
filter_list:
  - name: last-number
    filter:
      - {{function: regex, regex_pattern: "(-?[$0-9.,]{{2,}})|(-?[0-9]+)", group_select: -1}}
      - {{function: take_first}}
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true, ignore_punctuation: true}}
metadata: {{version: 1.0}}
"""


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--mmlu-dir", type=Path, default=Path.home() / ".cache" / "tunelab" / "eval-data")
    ap.add_argument("--gsm8k-dir", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "eval-data")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    subjects = sorted((args.mmlu_dir / "mmlu").glob("*/test.jsonl"))
    mc = [{"question": r["question"], "choices": r["choices"], "answer": r["answer"]}
          for path in subjects for r in map(json.loads, path.read_text().splitlines()[:4])]
    (args.out / "fixture_mc.yaml").write_text(MC.format(test=_jsonl(args.out / "mc.jsonl", mc)))
    gsm = [json.loads(x) for x in (args.gsm8k_dir / "gsm8k" / "main" / "test.jsonl").read_text().splitlines()]
    shots, test = _jsonl(args.out / "gen_shots.jsonl", gsm[:4]), _jsonl(args.out / "gen.jsonl", gsm[4:])
    (args.out / "fixture_gen.yaml").write_text(GEN.format(test=test, shots=shots))
    print(f"wrote {args.out}: fixture_mc ({len(mc)} MMLU questions), fixture_gen ({len(gsm) - 4} GSM8K problems)")


if __name__ == "__main__":
    main()
