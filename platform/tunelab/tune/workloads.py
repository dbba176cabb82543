"""Several workloads (`tune.workloads: [data.recipe, ...]`): matrix axes a method is tuned on, each with the same
budget. The expansion crosses every method group (include entries too) with the workload axes' values
(tunelab.matrix.expansion.combos); this checks the section at plan time. The leaderboard aggregates each method over
the workloads with a performance profile (tunelab.report.profiles)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tunelab.core.errors import UserError
from tunelab.matrix.schema import MatrixFile
from tunelab.matrix.tune_section import TuneSpec


def check(spec: MatrixFile, sections: list[tuple[TuneSpec, str]], path: Path) -> None:
    """Every workload key is a matrix axis, named by the matrix-level tune: section (it crosses every entry)."""
    top = spec.tune.workloads if spec.tune is not None else []
    for tune, at in sections:
        if tune.workloads and spec.tune is None:
            raise UserError("tune.workloads crosses every cell of the matrix with the workload axes: set it in the "
                            "matrix-level tune: section", file=path, key=f"{at}.workloads")
        if tune.workloads != top:  # an include's own section: the budget check names the difference first
            raise UserError(f"workloads {tune.workloads} differ from tune.workloads {top}: every method group is "
                            "tuned on the same workloads", file=path, key=f"{at}.workloads")
    for i, key in enumerate(top):
        if key not in spec.matrix:
            axes = ", ".join(spec.matrix) or "none"
            raise UserError(f"{key} is not a matrix axis (axes: {axes}); a workload is an axis whose values each "
                            f"method is tuned on, e.g. matrix: {{{key}: [a, b]}}", file=path,
                            key=f"tune.workloads[{i}]")


def parts(varying: dict[str, Any], workloads: list[str]) -> dict[str, dict[str, Any]]:
    """A group's keys as cells.json tells the leaderboard: the method (the keys that are no workload) and the
    workload (the workload axes' values), so rows of one method on several workloads can be aggregated."""
    return {"method": {k: v for k, v in varying.items() if k not in workloads},
            "workload": {k: varying.get(k) for k in workloads}}
