"""Recipe files (data_recipes/*.yaml): where examples come from, how they are read, cleaned and rendered.

The schema is the reference documentation (docs/data.md walks through it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tunelab.core.errors import UserError, explain, load_yaml
from tunelab.data.formats import FORMATS
from tunelab.data.generators import GENERATORS
from tunelab.data.sources import KINDS
from tunelab.data.templates import TEMPLATES
from tunelab.plan.sections import find_recipe


class Source(BaseModel):
    """One source of rows: a hub dataset, a local file or a built-in generator (exactly one)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    hub: str | None = Field(None, description="Hugging Face dataset id, e.g. tatsu-lab/alpaca")
    config: str | None = Field(None, description="hub dataset configuration (subset) name")
    split: str = Field("train", description="hub dataset split")
    revision: str | None = Field(None, description="hub dataset revision (branch, tag or commit)")
    path: str | None = Field(None, description="local .json, .jsonl, .parquet or .csv file, relative to the recipe")
    generator: str | None = Field(None, description=f"built-in generator: {', '.join(GENERATORS)}")
    args: dict[str, Any] = Field(default_factory=dict, description="generator arguments")
    format: str = Field("alpaca", description=f"row format: {', '.join(FORMATS)}")
    fields: dict[str, str] = Field(
        default_factory=dict, description="format field -> column of this source, e.g. {output: response}"
    )
    weight: float = Field(1.0, gt=0, description="share of the training mix: rows x weight (2 = twice, 0.5 = half)")
    limit: int | None = Field(None, gt=0, description="read only the first N rows")

    @model_validator(mode="after")
    def _one_kind(self):
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"a source has exactly one of {', '.join(map(repr, KINDS))} (got {given or 'none'})")
        if self.generator is not None and self.generator not in GENERATORS:
            raise ValueError(GENERATORS.unknown(self.generator))
        if self.format not in FORMATS:
            raise ValueError(FORMATS.unknown(self.format))
        unknown = sorted(set(self.fields) - set(FORMATS[self.format].load().fields))
        if unknown:
            raise ValueError(f"fields {unknown} are not fields of format {self.format!r}; "
                             f"its fields: {', '.join(FORMATS[self.format].load().fields)}")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    def label(self, index: int) -> str:
        """How errors and stats name this source: its position and what it reads."""
        return f"sources[{index}] ({self.kind}: {getattr(self, self.kind)})"


class Filters(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    empty_response: bool = Field(True, description="drop rows whose assistant reply is blank (or missing)")
    min_tokens: int | None = Field(None, ge=0, description="drop examples shorter than this (tokens, untruncated)")
    max_tokens: int | None = Field(None, gt=0, description="drop examples longer than this (tokens, untruncated)")

    @model_validator(mode="after")
    def _order(self):
        if self.min_tokens is not None and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) is above max_tokens ({self.max_tokens})")
        return self


class Dedup(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    exact: bool = Field(True, description="drop rows whose normalized text (lowercase, collapsed spaces) repeats")
    near: bool = Field(False, description="also drop near-duplicates found by MinHash LSH")
    threshold: float = Field(0.8, gt=0, le=1, description="estimated Jaccard similarity that counts as duplicate")
    num_perm: int = Field(128, ge=8, le=1024, description="MinHash permutations")
    ngram: int = Field(5, ge=1, le=20, description="word n-gram size of the shingles")


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    description: str = ""
    template: str = Field("alpaca", description=f"prompt template: {', '.join(TEMPLATES)}")
    sources: list[Source] = Field(min_length=1)
    filters: Filters = Filters()
    dedup: Dedup = Dedup()
    val_size: float = Field(0.05, gt=0, description="validation share (<1) or count (>=1)")
    seed: int = Field(0, description="seed of the train/validation split and of weighted sampling")

    @field_validator("template")
    @classmethod
    def _template(cls, v: str) -> str:
        if v not in TEMPLATES:
            raise ValueError(TEMPLATES.unknown(v))
        return v


def load_recipe(name: str) -> tuple[Recipe, Path]:
    try:
        path = find_recipe(name)
    except ValueError as e:
        raise UserError(str(e)) from None
    raw = load_yaml(path)
    if not isinstance(raw, dict):
        raise UserError("a recipe is a mapping with 'sources'", file=path)
    try:
        return Recipe.model_validate(raw), path
    except ValidationError as e:
        raise explain(e, Recipe, file=path) from None


def trained_template(config: dict) -> str | None:
    """The prompt template a cell trained with, from its config.yaml: data.template, else its recipe's; None if
    the recipe cannot be found any more."""
    data = config.get("data") or {}
    if data.get("template"):
        return data["template"]
    try:
        return load_recipe(data["recipe"])[0].template
    except (UserError, KeyError):
        return None


def input_files(name: str) -> list[Path]:
    """The files a recipe reads: itself and its local sources (for a failed cell's record of its input)."""
    from tunelab.data.sources import source_file

    recipe, path = load_recipe(name)
    return [path.resolve(), *(source_file(s, path) for s in recipe.sources if s.path)]


def check_files(name: str) -> None:
    """A recipe's local files exist, can be read and have a type the readers know: found at plan time, not when
    the cell builds its data."""
    import os

    from tunelab.data.sources import FILE_READERS, source_file

    recipe, path = load_recipe(name)
    for i, src in enumerate(recipe.sources):
        if not src.path:
            continue
        file, where = source_file(src, path), f"sources[{i}].path"
        if file.suffix.lower() not in FILE_READERS:
            raise UserError(f"cannot read {file.name!r}: the file types read are {', '.join(FILE_READERS)}",
                            file=path, key=where)
        if not file.is_file():
            raise UserError(f"file {str(file)!r} does not exist" + (" (it is a folder)" if file.is_dir() else ""),
                            file=path, key=where)
        if not os.access(file, os.R_OK):
            raise UserError(f"file {str(file)!r} cannot be read: permission denied", file=path, key=where)
