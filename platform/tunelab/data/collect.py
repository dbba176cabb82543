"""Recipe -> conversations: read every source, convert rows by format, drop empty replies and duplicates.

Everything before tokenization, shared by `build` and `exp data preview`. Counts per source go into the
returned `SourceStats`, which the build extends and stores as the dataset's stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tunelab.core.errors import UserError
from tunelab.data.dedup import conversation_text, exact_keep, near_keep
from tunelab.data.formats import FORMATS, RowError, has_response, trim
from tunelab.data.recipe import Recipe
from tunelab.data.sources import read_rows


@dataclass
class SourceStats:
    label: str
    weight: float
    read: int = 0
    empty_response: int = 0
    duplicates_exact: int = 0
    duplicates_near: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # tokenization drops, by reason
    examples: int = 0
    train: int = 0
    train_weighted: int = 0
    validation: int = 0


@dataclass
class Collected:
    convs: list[list[dict]]
    sources: list[int]
    origins: list[tuple[int, int]]  # (source, row) of each conversation, for error messages
    stats: list[SourceStats]


def _convert(recipe: Recipe, recipe_path: Path, index: int, st: SourceStats, limit: int | None):
    src = recipe.sources[index]
    fmt = FORMATS[src.format].load()
    rows = read_rows(src, recipe_path, index)
    st.read = len(rows)
    for j, row in enumerate(rows[:limit] if limit else rows):
        if not isinstance(row, dict):
            raise UserError(f"{src.label(index)}: row {j} is a {type(row).__name__}, expected a mapping of "
                            f"columns", file=recipe_path, key=f"sources[{index}]")
        try:
            conv = trim(fmt.to_conversation(row, src.fields))
        except RowError as e:
            raise UserError(f"{src.label(index)}: row {j} {e} -- map the format's fields to this source's "
                            f"columns with 'fields'", file=recipe_path,
                            key=f"sources[{index}].fields.{e.field}") from None
        if recipe.filters.empty_response and not has_response(conv):
            st.empty_response += 1
            continue
        yield j, conv


def collect(recipe: Recipe, recipe_path: Path, *, limit: int | None = None, dedup: bool = True) -> Collected:
    """`limit` reads only the first rows of each source (for previews)."""
    out = Collected([], [], [], [])
    for i, src in enumerate(recipe.sources):
        st = SourceStats(src.label(i), src.weight)
        out.stats.append(st)
        for j, conv in _convert(recipe, recipe_path, i, st, limit):
            out.convs.append(conv)
            out.sources.append(i)
            out.origins.append((i, j))
    if dedup:
        _dedup(recipe, out)
    return out


def _keep(out: Collected, keep: list[int], attr: str) -> None:
    kept = set(keep)
    for i, s in enumerate(out.sources):
        if i not in kept:
            setattr(out.stats[s], attr, getattr(out.stats[s], attr) + 1)
    out.convs = [out.convs[i] for i in keep]
    out.sources = [out.sources[i] for i in keep]
    out.origins = [out.origins[i] for i in keep]


def _dedup(recipe: Recipe, out: Collected) -> None:
    d = recipe.dedup
    if d.exact:
        _keep(out, exact_keep([conversation_text(c) for c in out.convs]), "duplicates_exact")
    if d.near:
        texts = [conversation_text(c) for c in out.convs]
        _keep(out, near_keep(texts, d.threshold, d.num_perm, d.ngram, seed=recipe.seed), "duplicates_near")
