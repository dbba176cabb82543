"""`--set KEY=VALUE`: a smaller stand-in of a study without editing its file. Cell keys go over every cell
(matrix axes included); `seeds`, `matrix.KEY` (an axis: its values) and the `tune:` section's own keys change the
matrix itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tunelab.core.errors import UserError, explain
from tunelab.matrix.schema import MatrixFile


def parse_sets(pairs: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` (repeatable) -> {dotted key: value}; VALUE is read as YAML (3, 1.0e-4, true, [a, b])."""
    import yaml

    out: dict[str, Any] = {}
    for p in pairs:
        key, eq, text = p.partition("=")
        if not eq or not key or " " in key:
            raise UserError(f"--set {p!r}: expected KEY=VALUE with a dotted config key, e.g. train.steps=10")
        try:
            out[key] = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise UserError(f"--set {p!r}: the value is not valid YAML ({str(e).splitlines()[0]})") from None
    return out


def cell_sets(sets: dict[str, Any] | None) -> dict[str, Any]:
    """The --set keys that go to every cell: all but the matrix-level ones (`seeds`, `matrix.*`, `tune.*`)."""
    return {k: v for k, v in (sets or {}).items() if k != "seeds" and not k.startswith(("tune.", "matrix."))}


def matrix_sets(spec: MatrixFile, sets: dict[str, Any], path: Path) -> MatrixFile:
    """The matrix-level keys --set may change (a smaller stand-in of a study): `seeds`, an axis's values
    (`matrix.data.recipe=[a, b]`: a stand-in's workloads) and the keys of the matrix-level `tune:` section
    (tune.trials, tune.min_steps, ...). They are taken out of `sets`."""
    changes: dict[str, Any] = {}
    if "seeds" in sets:
        changes["seeds"] = sets.pop("seeds")
    axes = {k.removeprefix("matrix."): sets.pop(k) for k in list(sets) if k.startswith("matrix.")}
    for key, values in axes.items():
        if not isinstance(values, list) or not values:
            raise UserError(f"--set matrix.{key}={values!r}: an axis is a list of one or more values, e.g. "
                            f"--set 'matrix.{key}=[a, b]'", file=path)
        if key in sets:
            raise UserError(f"--set {key} and --set matrix.{key}: set the key for every cell or make it an axis, "
                            "not both", file=path)
    if axes:
        changes["matrix"] = {**spec.matrix, **axes}
    tune = {k.removeprefix("tune."): sets.pop(k) for k in list(sets) if k.startswith("tune.")}
    if tune:
        if spec.tune is None:
            raise UserError(f"--set tune.{next(iter(tune))}: the file has no matrix-level tune: section", file=path)
        nested = [k for k in tune if "." in k]
        if nested:
            raise UserError(f"--set tune.{nested[0]}: --set changes the tune section's own keys (tune.trials, "
                            "tune.min_steps, ...), not its space", file=path)
        changes["tune"] = {**spec.tune.model_dump(exclude_unset=True), **tune}
    if not changes:
        return spec
    try:
        return MatrixFile.model_validate({**spec.model_dump(exclude_unset=True), **changes})
    except ValidationError as e:
        raise explain(e, MatrixFile, file=path, where=lambda loc: "--set " + ".".join(map(str, loc))) from None
