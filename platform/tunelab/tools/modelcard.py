"""The README.md model card of an exported cell: what the folder holds, how to load it, scores, config.

Scores are marked as the leaderboard marks them: `*` a subset of the benchmark, `_smoke` in a task's name a
stand-in that is not the benchmark, `unavailable` a test set that could not be loaded.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tunelab import __version__
from tunelab.folders.cell import CellFolder
from tunelab.plan.sections import HUB_ID
from tunelab.report.scores import fmt

KINDS = {
    "full": "the full fine-tuned weights",
    "merged": "the base model with the {method} adapter merged into its weights",
    "adapter": "the {method} adapter only (not the base weights); loading it needs the `peft` package",
}

SCORE_NOTE = ("`*`: a subset of the benchmark (see n); a task named `*_smoke`: a stand-in built to exercise the "
              "pipeline, not the benchmark; `unavailable`: the test set could not be loaded, so there is no score.")

TRAIN_KEYS = ("steps", "final_loss", "val_loss", "tokens_per_s", "train_seconds", "trainable_params",
              "total_params", "precision", "world_size")


def _score(res: dict) -> str:
    if res.get("status", "ok") != "ok":
        return "unavailable" + (f" ({res['reason']})" if res.get("reason") else "")
    value = fmt(res.get("value"))
    return f"{value}*" if res.get("subset") else value


def scores_markdown(cell: CellFolder) -> str:
    results = cell.evaluations()
    if not results:
        return "No evaluation results were found in the cell's eval/ folder.\n"
    lines = ["| eval set | task | metric | score | n | stderr |", "|---|---|---|---|---|---|"]
    for eval_id, res in results:  # newest first
        for task, r in (res.get("tasks") or {}).items():
            lines.append(f"| {eval_id} | {task} | {r.get('metric', '')} | {_score(r)} | {fmt(r.get('n'))} | "
                         f"{fmt(r.get('stderr'))} |")
    return "\n".join(lines) + "\n\n" + SCORE_NOTE + "\n"


def _loading(kind: str, base_path: str) -> str:
    if kind == "adapter":
        return ("```python\nfrom peft import AutoPeftModelForCausalLM\nfrom transformers import AutoTokenizer\n\n"
                "model = AutoPeftModelForCausalLM.from_pretrained(\"THIS_FOLDER\")\n"
                "tokenizer = AutoTokenizer.from_pretrained(\"THIS_FOLDER\")\n```\n\n"
                f"peft loads the base model from `base_model_name_or_path` in adapter_config.json "
                f"(`{base_path}`); point it elsewhere if the base lives in another place on your machine.\n")
    return ("```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            "model = AutoModelForCausalLM.from_pretrained(\"THIS_FOLDER\")\n"
            "tokenizer = AutoTokenizer.from_pretrained(\"THIS_FOLDER\")\n```\n")


def render(cell: CellFolder, kind: str, *, base_path: str, template: str | None, notes: list[str]) -> str:
    hub_base = cell.base if HUB_ID.match(cell.base) and not Path(cell.base).expanduser().exists() else None
    front = ["---", f"library_name: {'peft' if kind == 'adapter' else 'transformers'}",
             "pipeline_tag: text-generation", "tags:", "- tunelab", f"- {cell.method}"]
    if hub_base:
        front.insert(1, f"base_model: {hub_base}")
    front.append("---")
    summary = cell.summary()
    train_rows = [f"| {k} | {fmt(summary[k])} |" for k in TRAIN_KEYS if k in summary]
    parts = [
        "\n".join(front), "",
        f"# {cell.title}", "",
        f"Exported by tunelab {__version__} on {time.strftime('%Y-%m-%d %H:%M:%S %Z')} from the cell folder "
        f"`{cell.path.resolve()}` (cell id `{cell.meta().get('id', '?')}`).", "",
        f"This folder holds {KINDS[kind].format(method=cell.method)}. Base model: `{cell.base}`"
        + (f" (loaded from `{base_path}`)" if base_path != cell.base else "") + ".",
        "",
        *(f"**Note:** {n}\n" for n in notes),
        f"Prompt format the cell trained with: `{template or 'unknown (its recipe could not be found)'}`"
        + (" (Stanford Alpaca's instruction prompt; see `exp data preview`)." if template == "alpaca" else "."),
        "", "## Loading", "", _loading(kind, base_path),
        "## Scores", "", scores_markdown(cell),
        "## Training", "",
        *(["| key | value |", "|---|---|", *train_rows, ""] if train_rows else ["No train/summary.json.", ""]),
        "Varying keys of this cell in its matrix: `"
        + json.dumps(cell.meta().get("varying", {}), sort_keys=True) + "`", "",
        "## Config", "", "The cell's resolved config (config.yaml):", "",
        "```yaml", cell.config_file.read_text().rstrip(), "```", "",
    ]
    return "\n".join(parts)
