"""The `run:` section of a matrix file: how `exp run` runs its cells, not what they are, so it is part of no cell's
id (like `launcher:`). `together`: cells sharing a frozen base train in one process (run/together.py); the command
line's `--together` and `--together-mode` go over it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class RunSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    together: str | int = Field("auto", description="cells that share a frozen base (model, data, batch shape) and "
                                "differ in their adapters and optimizers train in one process: auto (as many as "
                                "the device's memory fits), off, or at most N members (docs/training.md)")
    together_mode: Literal["exact", "batched"] = Field(
        "exact", description="exact: each member steps alone over the shared base, bit for bit the cell alone; "
                             "batched: all members' rows of a step in one pass through the base, each row through "
                             "its own adapter (one step within 1e-6 of alone; docs/training.md)")

    @field_validator("together", mode="before")
    @classmethod
    def _together(cls, v: object) -> str | int:
        if v is False:  # YAML reads a bare `off` (and no, false) as false
            return "off"
        text = str(v).strip().lower() if isinstance(v, str | int) and not isinstance(v, bool) else None
        if text is None or text not in ("auto", "off") and not (text.isdigit() and int(text) >= 1):
            raise ValueError(f"auto, off, or a number of members (1 or more; 1 is off); got {v!r}"
                             + (" (write auto, or a number)" if v is True else ""))
        return v  # type: ignore[return-value]
