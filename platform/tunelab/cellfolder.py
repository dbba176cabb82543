"""A cell's folder as the everyday commands (export, chat, clean) read it, after the run is over.

The raw config.yaml is read, not validated into a CellConfig: validation resolves the recipe and the model
name, and a finished cell must stay readable when its recipe file has moved or it was copied elsewhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from tunelab.errors import UserError
from tunelab.registries import PEFT
from tunelab.store import read_json, read_status

# Methods whose adapter peft can fold into the base weights; prompt-learning ones add virtual tokens instead.
MERGEABLE = tuple(n for n, p in PEFT.items() if n != "none" and not p.prompt_learning)


@dataclass(frozen=True)
class CellFolder:
    path: Path
    config: dict  # config.yaml as written by the runner (every key resolved)
    state: str
    meta: dict  # cell.json: matrix, id, slug, varying keys

    @property
    def final(self) -> Path:
        return self.path / "final"

    @property
    def method(self) -> str:
        return (self.config.get("peft") or {}).get("method", "none")

    @property
    def base(self) -> str:
        """The base model as the cell named it: catalog alias, folder or hub id."""
        return self.config["model"]["name"]

    @property
    def title(self) -> str:
        return f"{self.meta.get('matrix', '?')}/{self.meta.get('slug', self.path.name)}"

    def template(self) -> str | None:
        """The prompt template the cell trained with (data.template, else its recipe's); None if the recipe
        cannot be found any more."""
        data = self.config.get("data") or {}
        if data.get("template"):
            return data["template"]
        from tunelab.data.recipe import load_recipe

        try:
            return load_recipe(data["recipe"])[0].template
        except (UserError, KeyError):
            return None


def is_cell(path: Path) -> bool:
    return (path / "config.yaml").is_file() and (path / "cell.json").is_file()


def open_cell(path: Path) -> CellFolder:
    if not path.is_dir():
        raise UserError("no such folder; expected a cell folder runs/<matrix>/<cell>/", file=path)
    if not is_cell(path):
        raise UserError("not a cell folder: it has no config.yaml and cell.json (a cell folder is "
                        "runs/<matrix>/<slug>-<id>/, as listed by `exp status runs/<matrix>`)", file=path)
    config = yaml.safe_load((path / "config.yaml").read_text()) or {}
    return CellFolder(path, config, read_status(path).get("state", "?"), read_json(path / "cell.json") or {})


def open_finished(path: Path, command: str) -> CellFolder:
    """A cell that is done and has final/ weights; anything else is a UserError naming what is missing."""
    cell = open_cell(path)
    if cell.state != "done":
        raise UserError(f"the cell is {cell.state}, not done; `exp {command}` needs a finished cell "
                        f"(see `exp status {path.parent}`)", file=path)
    final = cell.final
    if not ((final / "config.json").is_file() or (final / "adapter_config.json").is_file()):
        raise UserError("the cell is done but has no final/ weights (train.save_final was false, or final/ was "
                        "removed); nothing to load", file=path)
    return cell


def disk_usage(path: Path) -> int:
    """Bytes in the files under path (apparent sizes; links are not followed)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # a file removed while we walk (a checkpoint being rotated)
                pass
    return total


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
