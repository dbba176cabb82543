"""The schema of a matrix file: its top-level keys. A cell's own keys are tunelab.core.config's CellConfig; the
`launcher:`, `run:` and `tune:` sections have modules of their own."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tunelab.matrix.launcher import SlurmCfg
from tunelab.matrix.run_section import RunSection
from tunelab.matrix.tune_section import TuneSpec


class MatrixFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="runs go to runs/<name>/")
    description: str = ""
    base: dict[str, Any] = Field(default_factory=dict, description="partial cell config shared by all cells")
    matrix: dict[str, list[Any]] = Field(default_factory=dict, description="dotted key -> values")
    include: list[dict[str, Any]] = Field(default_factory=list, description="extra cells (dotted keys)")
    exclude: list[dict[str, Any]] = Field(default_factory=list, description="drop cells matching all keys")
    seeds: list[int] | None = Field(None, min_length=1, description="run every cell with each train.seed")
    launcher: SlurmCfg = Field(default_factory=SlurmCfg, description="SLURM job settings for --launcher slurm")
    run: RunSection = Field(default_factory=RunSection, description="how `exp run` runs the cells (together-groups); "
                            "part of no cell's id")
    tune: TuneSpec | None = Field(None, description="search these keys per method group with the same budget "
                                  "(docs/tuning.md); an include entry's own `tune:` goes over it, `tune: false` "
                                  "leaves the entry untuned")
