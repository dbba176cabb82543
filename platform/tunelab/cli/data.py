"""`exp data ...`: build, inspect and preview recipes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from tunelab import plan
from tunelab.cli.common import INSPECT, app, out, print_wide
from tunelab.core.config import DataCfg
from tunelab.core.errors import UserError, explain
from tunelab.core.paths import cache_dir as default_cache

data_app = typer.Typer(no_args_is_help=True)
app.add_typer(data_app, name="data", help="Build, inspect and preview data recipes.", rich_help_panel=INSPECT)

Recipe = Annotated[str, typer.Argument(help="recipe name in data_recipes/ or a path to a recipe YAML")]
Model = Annotated[str, typer.Option("--model", "-m", help="model whose tokenizer is used: alias, folder or hub id")]
MaxLength = Annotated[int, typer.Option(help="tokens per example (and per packed row)")]
Template = Annotated[str | None, typer.Option(help="override the recipe's template: alpaca, chat, plain")]
Truncation = Annotated[str, typer.Option(help="cut or drop examples longer than --max-length")]
TrainOnPrompt = Annotated[bool, typer.Option(help="also train on prompt tokens")]
Pack = Annotated[bool, typer.Option(help="pack training examples into rows of --max-length tokens")]
NumProc = Annotated[int | None, typer.Option(help="tokenizer worker processes (default: by dataset size)")]
CacheDir = Annotated[Path | None, typer.Option(help="cache root (default: $TUNELAB_CACHE or ~/.cache/tunelab)")]


def data_cfg(**values):
    try:
        return plan.section_config("data", {k: v for k, v in values.items() if v is not None})
    except plan.Invalid as e:
        raise explain(e, DataCfg, file="command line", where=lambda loc: "--" + "-".join(map(str, loc))) from None


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    from tunelab.models.loading import resolve  # torch: imported when a command needs it, so `exp --help` stays quick

    try:
        plan.section_config("model", {"name": name})
    except plan.Invalid as e:
        raise UserError(e.problems[0].message, key="--model") from None
    tok = AutoTokenizer.from_pretrained(resolve(name))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _built(recipe, model, max_length, template, truncation, train_on_prompt, pack, num_proc, cache_dir):
    from tunelab.data.build import build_info

    cfg = data_cfg(recipe=recipe, max_length=max_length, template=template, truncation=truncation,
                   train_on_prompt=train_on_prompt, pack=pack)
    tok = load_tokenizer(model)
    with Progress(TextColumn("tokenizing"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("tokenizing", total=None)
        return build_info(cfg, tok, cache_dir or default_cache(), num_proc=num_proc,
                          progress=lambda done, total: bar.update(task, completed=done, total=total))


@data_app.command()
def build(recipe: Recipe, model: Model, max_length: MaxLength = 512, template: Template = None,
          truncation: Truncation = "cut", train_on_prompt: TrainOnPrompt = False, pack: Pack = False,
          num_proc: NumProc = None, cache_dir: CacheDir = None) -> None:
    """Build (or find in the cache) a recipe's tokenized train/validation sets for a model's tokenizer."""
    b = _built(recipe, model, max_length, template, truncation, train_on_prompt, pack, num_proc, cache_dir)
    how = "cached" if b.cached else f"built in {b.stats['build_seconds']:.1f} s"
    rows = ", ".join(f"{name} {len(ds)} rows" for name, ds in b.datasets.items())
    out.print(f"{recipe}: {rows} ({how})\n{b.path}")


@data_app.command()
def stats(recipe: Recipe, model: Model, max_length: MaxLength = 512, template: Template = None,
          truncation: Truncation = "cut", train_on_prompt: TrainOnPrompt = False, pack: Pack = False,
          num_proc: NumProc = None, cache_dir: CacheDir = None,
          as_json: Annotated[bool, typer.Option("--json", help="print the stats as JSON")] = False) -> None:
    """Counts per source, duplicates removed, token-length percentiles and the share truncated."""
    s = _built(recipe, model, max_length, template, truncation, train_on_prompt, pack, num_proc, cache_dir).stats
    if as_json:
        out.print_json(json.dumps(s))
        return
    from tunelab.data.preview import stats_tables

    for table in stats_tables(s):
        print_wide(table)


@data_app.command()
def preview(recipe: Recipe, n: Annotated[int, typer.Option("-n", help="examples to show")] = 5,
            model: Annotated[str | None, typer.Option("--model", "-m", help="show tokens of this model's "
                                                      "tokenizer; without it, text segments")] = None,
            max_length: MaxLength = 512, template: Template = None, truncation: Truncation = "cut",
            train_on_prompt: TrainOnPrompt = False) -> None:
    """Render the first examples of a recipe; trained text is highlighted, masked text dimmed."""
    from tunelab.data import preview as pv

    cfg = data_cfg(recipe=recipe, max_length=max_length, template=template, truncation=truncation,
                   train_on_prompt=train_on_prompt)
    tok = load_tokenizer(model) if model else None
    for panel in pv.panels(cfg, tok, n):
        out.print(panel)
    out.print(pv.legend())
