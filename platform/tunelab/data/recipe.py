"""Recipe files (data_recipes/*.yaml): where examples come from and how they are rendered."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tunelab.data.generators import GENERATORS
from tunelab.data.templates import TEMPLATES
from tunelab.errors import UserError, explain, load_yaml
from tunelab.paths import available, find_named


class Source(BaseModel):
    """One source: a built-in generator or a local JSON/JSONL file in the Alpaca schema."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    generator: str | None = Field(None, description="built-in generator name")
    args: dict[str, Any] = Field(default_factory=dict, description="generator arguments")
    path: str | None = Field(None, description="JSON or JSONL file, relative to the recipe")
    limit: int | None = Field(None, gt=0, description="keep the first N rows")

    @model_validator(mode="after")
    def _one_kind(self):
        if (self.generator is None) == (self.path is None):
            raise ValueError("a source has exactly one of 'generator' or 'path'")
        if self.generator is not None and self.generator not in GENERATORS:
            raise ValueError(f"unknown generator {self.generator!r}; known: {', '.join(GENERATORS)}")
        return self


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    description: str = ""
    template: str = Field("alpaca", description=f"one of: {', '.join(TEMPLATES)}")
    sources: list[Source] = Field(min_length=1)
    val_size: float = Field(0.05, gt=0, description="validation share (<1) or count (>=1)")
    seed: int = Field(0, description="seed of the train/validation split")

    @field_validator("template")
    @classmethod
    def _template(cls, v: str) -> str:
        if v not in TEMPLATES:
            raise ValueError(f"unknown template {v!r}; known: {', '.join(TEMPLATES)}")
        return v


def find_recipe(name: str) -> Path:
    path = find_named("data_recipes", name)
    if path is None:
        raise ValueError(f"no recipe {name!r}: not a file and not in data_recipes/ "
                         f"(available: {', '.join(available('data_recipes'))})")
    return path


def load_recipe(name: str) -> tuple[Recipe, Path]:
    path = find_recipe(name)
    raw = load_yaml(path)
    if not isinstance(raw, dict):
        raise UserError("a recipe is a mapping with 'sources'", file=path)
    try:
        return Recipe.model_validate(raw), path
    except ValidationError as e:
        raise explain(e, Recipe, file=path) from None


REQUIRED = ("instruction", "output")


def read_source(src: Source, recipe_path: Path, index: int) -> list[dict]:
    if src.generator:
        rows = GENERATORS[src.generator](**src.args)
    else:
        file = (recipe_path.parent / src.path).resolve()
        if not file.is_file():
            raise UserError(f"file {str(file)!r} does not exist", file=recipe_path, key=f"sources[{index}].path")
        text = file.read_text()
        rows = json.loads(text) if file.suffix == ".json" else [json.loads(x) for x in text.splitlines() if x.strip()]
    rows = rows[: src.limit] if src.limit else rows
    for i, row in enumerate(rows):
        missing = [k for k in REQUIRED if not isinstance(row.get(k), str)]
        if missing:
            raise UserError(f"row {i} lacks string field(s) {missing}; the Alpaca schema is instruction, "
                            f"input (optional), output", file=recipe_path, key=f"sources[{index}]")
    return [{"instruction": r["instruction"], "input": r.get("input") or "", "output": r["output"]} for r in rows]


def source_fingerprint(src: Source, recipe_path: Path) -> str:
    """What a source's rows depend on, for the dataset cache key."""
    if src.path:
        file = (recipe_path.parent / src.path).resolve()
        return f"{file}:{file.stat().st_size}:{file.stat().st_mtime_ns}" if file.exists() else str(file)
    return src.model_dump_json()
