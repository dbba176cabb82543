"""The `launcher:` section of a matrix file: how `exp run --launcher slurm` asks SLURM for each cell's job
(tunelab.run.slurm writes and submits the jobs). It names no training setting, so it is part of no cell's id."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tunelab.core.errors import UserError

_TIME = re.compile(r"^(?:(\d+)-(\d+)(?::(\d+))?(?::(\d+))?|(\d+)(?::(\d+))?(?::(\d+))?)$")


def slurm_seconds(time: str) -> int:
    """SLURM's --time in seconds: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
    days-hours:minutes or days-hours:minutes:seconds."""
    m = _TIME.match(time)
    if not m:
        raise ValueError(f"{time!r} is no SLURM time limit (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS)")
    d, h, dm, ds, a, b, c = (int(x) if x else 0 for x in m.groups())
    if m.group(1) is not None:
        return ((d * 24 + h) * 60 + dm) * 60 + ds
    if m.group(7) is not None:  # hours:minutes:seconds
        return (a * 60 + b) * 60 + c
    return a * 60 + b  # minutes[:seconds]


class SlurmCfg(BaseModel):
    """The `launcher:` section: how `exp run --launcher slurm` asks SLURM for each cell's job (docs/parallelism.md).
    It names no training setting, so it is part of no cell's id."""

    model_config = ConfigDict(extra="forbid")
    partition: str | None = Field(None, description="#SBATCH --partition")
    time: str | None = Field(None, description="#SBATCH --time: the job's time limit (e.g. 04:00:00, 2-00:00:00)")
    account: str | None = Field(None, description="#SBATCH --account")
    qos: str | None = Field(None, description="#SBATCH --qos")
    gpus_per_node: int | None = Field(None, ge=1, description="#SBATCH --gpus-per-node")
    cpus_per_task: int | None = Field(None, ge=1, description="#SBATCH --cpus-per-task (one task per node)")
    mem: str | None = Field(None, pattern=r"^\d+[KMGT]?$", description="#SBATCH --mem per node, e.g. 64G")
    array: bool = Field(False, description="submit the cells as job arrays (one per process count) instead of "
                                           "one job per cell")
    signal_grace_s: int = Field(180, ge=10, description="SLURM sends SIGUSR1 this many seconds before the time "
                                "limit: the cell checkpoints, marks itself pending and requeues its job")
    sbatch: list[str] = Field(default_factory=list, description="more #SBATCH options, one per item "
                              "(e.g. --constraint=h100, --exclusive)")
    setup: list[str] = Field(default_factory=list, description="shell lines the job runs first (module load ..., "
                             "source .venv/bin/activate)")

    @field_validator("time")
    @classmethod
    def _time(cls, v: str | None) -> str | None:
        if v is not None:
            slurm_seconds(v)
        return v

    @field_validator("sbatch")
    @classmethod
    def _options(cls, v: list[str]) -> list[str]:
        out = []
        for line in v:
            opt = line.strip().removeprefix("#SBATCH").strip()
            if not opt.startswith("-") or "\n" in opt:
                raise ValueError(f"{line!r} is no sbatch option: write one option per item, like --exclusive or "
                                 "--constraint=h100")
            out.append(opt)
        return out

    @field_validator("setup", "partition", "account", "qos")
    @classmethod
    def _one_line(cls, v):
        for line in [v] if isinstance(v, str) else v or []:
            if "\n" in line:
                raise ValueError("one line per item")
        return v

    @model_validator(mode="after")
    def _grace_within_time(self):
        if self.time is not None:
            limit = slurm_seconds(self.time)
            if self.signal_grace_s >= limit:
                raise ValueError(f"signal_grace_s {self.signal_grace_s} is not shorter than the time limit "
                                 f"{self.time} ({limit} s)")
        return self


def with_overrides(cfg: SlurmCfg, flags: dict[str, Any]) -> SlurmCfg:
    """The launcher section with command-line values (--partition, --time, ...) put over it, checked again."""
    try:
        return SlurmCfg.model_validate({**cfg.model_dump(), **flags})
    except ValidationError as e:
        raise UserError("; ".join(f"--{'-'.join(map(str, err['loc'])).replace('_', '-') or 'launcher'}: "
                                  f"{err['msg']}" for err in e.errors())) from None
