"""Rich renderings for `exp data preview` (examples, trained tokens highlighted) and `exp data stats`."""

from __future__ import annotations

from itertools import zip_longest
from typing import Any

from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from tunelab.core.config import DataCfg
from tunelab.core.errors import UserError
from tunelab.data.collect import collect
from tunelab.data.recipe import load_recipe
from tunelab.data.templates import TEMPLATES, TemplateError
from tunelab.data.tokenize import IGNORE, Settings, tokenize_chunk

# Neighbouring tokens alternate between two shades, so token boundaries stay visible.
TRAINED = ("black on green", "black on bright_green")
MASKED = ("grey50", "grey70")


def legend() -> Text:
    return Text.assemble(("trained", TRAINED[0]), " ", ("masked", MASKED[0]), "  (EOS shown as ⏎EOS)")


def _interleave(got, n: int) -> list[int]:
    """The first examples of every source in turn, so a mixture's preview shows each source."""
    by_source: dict[int, list[int]] = {}
    for i, s in enumerate(got.sources):
        by_source.setdefault(s, []).append(i)
    order = [i for group in zip_longest(*by_source.values()) for i in group if i is not None]
    return order[:n]


def _text_only(segs, train_on_prompt: bool) -> Text:
    text = Text()
    for k, seg in enumerate(segs):
        style = TRAINED[k % 2] if seg.trained or train_on_prompt else MASKED[k % 2]
        text.append(seg.text, style=style)
        if seg.eos:
            text.append("⏎EOS", style=style)
    return text


def _tokens(tokenizer, ids, labels) -> Text:
    text, eos = Text(), tokenizer.eos_token_id
    for k, (i, label) in enumerate(zip(ids, labels)):
        style = (TRAINED if label != IGNORE else MASKED)[k % 2]
        text.append("⏎EOS" if i == eos else tokenizer.decode([int(i)]), style=style)
    return text


def panels(cfg: DataCfg, tokenizer: Any, n: int) -> list[Panel]:
    recipe, path = load_recipe(cfg.recipe)
    template = TEMPLATES[cfg.template or recipe.template].load()
    got = collect(recipe, path, limit=n, dedup=False)
    settings = Settings(template, cfg.max_length, cfg.train_on_prompt, cfg.truncation,
                        recipe.filters.min_tokens, recipe.filters.max_tokens)
    out = []
    for i in _interleave(got, n):
        conv, (s, row) = got.convs[i], got.origins[i]
        title = f"{recipe.sources[s].label(s)} row {row}"
        try:
            if tokenizer is None:
                body, note = _text_only(template.segments(conv), cfg.train_on_prompt), "text segments (no --model)"
            else:
                ex = tokenize_chunk([conv], [s], tokenizer, settings)
                if len(ex) == 0:
                    reason = next(iter(ex.dropped))[1]
                    out.append(Panel(Text(f"dropped: {reason}", style="red"), title=title))
                    continue
                ids, labels = ex.ids, ex.labels
                body = _tokens(tokenizer, ids, labels)
                trained = int((labels != IGNORE).sum())
                cut = f", truncated from {int(ex.length[0])}" if ex.truncated[0] else ""
                note = f"{len(ids)} tokens{cut}, {trained} trained"
        except TemplateError as e:
            raise UserError(f"{title}: {e}", file=path, key="template") from None
        out.append(Panel(body, title=title, subtitle=note))
    return out


def stats_tables(s: dict) -> list[Table]:
    """One column per source (narrow terminals keep it readable), then the token summary."""
    src = Table(title=f"{s['recipe']} ({s['template']} template, max_length {s['max_length']})")
    src.add_column("")
    for x in s["sources"]:
        src.add_column(x["label"], justify="right")
    rows = [("weight", "weight"), ("rows read", "read"), ("empty reply", "empty_response"),
            ("duplicates, exact", "duplicates_exact"), ("duplicates, near", "duplicates_near"),
            ("dropped at tokenization", "dropped"), ("examples", "examples"), ("train", "train"),
            ("train x weight", "train_weighted"), ("validation", "validation")]
    for name, key in rows:
        cells = [x[key] for x in s["sources"]]
        if key == "dropped":
            cells = [", ".join(f"{k} {v}" for k, v in c.items()) or "0" for c in cells]
        src.add_row(name, *(f"{c:g}" if isinstance(c, float) else str(c) for c in cells))
    t = s["tokens_untruncated"]
    summary = Table(title="tokens per example (before truncation)", show_header=False)
    summary.add_column("what")
    summary.add_column("value", justify="right")
    rows = [*((f"p{p}", f"{t[f'p{p}']:.0f}") for p in (50, 90, 95, 99)), ("mean", f"{t['mean']:.1f}"),
            ("max", str(t["max"])),
            ("truncated", f"{s['truncated']} ({100 * s['truncated_share']:.1f}%, policy: {s['truncation']})"),
            ("duplicates removed", f"exact {s['duplicates_removed']['exact']}, near {s['duplicates_removed']['near']}"),
            ("train rows / tokens / trained", f"{s['rows']['train']} / {s['train_tokens']} / {s['trained_tokens']}"),
            ("validation rows", str(s["rows"]["validation"]))]
    if "packing" in s:
        p = s["packing"]
        rows.append(("packing", f"{p['examples']} examples in {p['rows']} rows, {100 * p['fill']:.1f}% full"))
    for r in rows:
        summary.add_row(*r)
    return [src, summary]
