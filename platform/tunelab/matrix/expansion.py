"""Matrix files -> resolved cells, each checked by tunelab.plan: the product of the axes, less the excluded
combinations, plus the included cells, times the seeds; slugs that tell the cells apart.

A cell's id is a short hash of its training config (CellConfig.id: the folder of the trained model); its
eval_id one of its eval section (EvalCfg.id: the results of one evaluation of that model).
"""

from __future__ import annotations

import copy
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tunelab import plan
from tunelab.core.config import CellConfig, world_size
from tunelab.core.errors import Errors, UserError, explain, load_yaml
from tunelab.core.keys import flatten, get_dotted, set_dotted
from tunelab.matrix import input_checks
from tunelab.matrix.schema import MatrixFile
from tunelab.matrix.sets import matrix_sets
from tunelab.matrix.tune_section import TuneSpec, merged


@dataclass(frozen=True)
class Cell:
    config: CellConfig
    id: str  # the trained model's: config.id()
    slug: str
    varying: dict[str, Any] = field(default_factory=dict)
    eval_id: str = ""  # the evaluation's: config.eval.id()
    # Not part of the cell's identity: how far this run of it may train (a search's rung: it checkpoints there
    # and stops, tunelab.tune), where it validates on the way (its search's rungs), and what cells.json says of it
    # besides its id (its role in a search).
    stop_at: int | None = None
    validate_at: tuple[int, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def dirname(self) -> str:
        return f"{self.slug}-{self.id}"

    @property
    def world_size(self) -> int:
        """Processes its training needs (the runner starts that many under torchrun)."""
        return world_size(self.config.parallel)

    @property
    def checkpoints(self) -> dict[str, Any] | None:
        """Its checkpoints' evaluation: {eval_id, steps} (eval/<eval_id>/step-N/), None without one."""
        ecfg = self.config.checkpoint_eval_id()
        return None if ecfg is None else {"eval_id": ecfg, "steps": list(self.config.checkpoint_steps())}


def _origin(loc: tuple, origins: dict[str, str]) -> str:
    """The place in the matrix file a config loc came from (the longest matching dotted key)."""
    dotted = ".".join(map(str, loc))
    best = max((k for k in origins if dotted == k or dotted.startswith(k + ".")), key=len, default=None)
    if best is None:
        return f"base.{dotted}"
    return origins[best] + dotted[len(best):]


def _slug_part(key: str, value: Any) -> str:
    """Strings stand for themselves; numbers and flags carry their key's last part (lr2e-05)."""
    leaf = key.rsplit(".", 1)[-1]
    if key == "train.seed":
        return f"s{value}"
    if isinstance(value, bool):
        return leaf if value else f"no_{leaf}"
    if isinstance(value, (int, float)):
        return f"{leaf}{value:g}"
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    text = text.rsplit("/", 1)[-1]
    return "".join(c if c.isalnum() or c in ".+-" else "_" for c in text).strip("_") or "x"


def load(path: str | Path, sets: dict[str, Any] | None = None,
         errors: Errors | None = None) -> tuple[MatrixFile, list[Cell]]:
    """The cells of a matrix file; `sets` (from --set) override every cell's keys, matrix axes included. Every
    error of the file is said at once: the schema's, every cell's; `errors` given, they are left in it for the
    caller to add its own (a tune: section's) and raise, and the cells that are sound are returned."""
    path = Path(path)
    own = errors is None
    errors = Errors(path) if errors is None else errors
    raw = load_yaml(path)
    if not isinstance(raw, dict):
        raise UserError("a matrix file is a mapping with keys name, base, matrix, include, exclude, seeds",
                        file=path)
    spec = _schema(raw, path, errors)
    sets = dict(sets or {})
    spec = matrix_sets(spec, sets, path)
    cells = expand(spec, path, sets, errors)
    if not errors:
        input_checks.check([c.config for c in cells], path)
    if own:
        errors.raise_any()
    return spec, cells


SALVAGED = ("tune", "launcher", "include", "exclude", "seeds", "description")  # keys the cells can be read without


def _schema(raw: dict, path: Path, errors: Errors) -> MatrixFile:
    """The file's top-level schema; when only keys the cells do not need are wrong (a typo in tune:), their
    errors are collected and the cells are still checked without them."""
    try:
        return MatrixFile.model_validate(raw)
    except ValidationError as e:
        wrong = {str(err["loc"][0]) for err in e.errors() if err["loc"]}
        if not wrong or not wrong <= set(SALVAGED):
            raise explain(e, MatrixFile, file=path) from None
        errors.add(explain(e, MatrixFile, file=path))
        try:
            return MatrixFile.model_validate({k: v for k, v in raw.items() if k not in wrong})
        except ValidationError:
            errors.raise_any()
            raise


@dataclass(frozen=True)
class Combo:
    """One cell of the matrix before seeds: its keys, where in the file each came from, and its search (a
    `tune:` section applies: the combo is a method group of tunelab.tune, not a cell)."""

    picks: dict[str, Any]
    origins: dict[str, str]
    tune: TuneSpec | None = None
    tune_at: str = "tune"  # where its tune section is in the file


def combos(spec: MatrixFile, path: Path) -> list[Combo]:
    """The product of the axes, less the excluded combinations, plus the included cells (seeds not applied)."""
    for key, values in spec.matrix.items():
        if not values:
            raise UserError("an axis needs at least one value", file=path, key=f"matrix.{key}")
    axes = list(spec.matrix.items())
    workloads = _workload_axes(spec)
    # Axes that are all workloads, and include entries: the entries are the methods, each crossed with the workloads
    # below (the product alone would add the base cell as one more method on each workload)
    only_workloads = bool(workloads) and len(workloads) == len(axes) and bool(spec.include)
    out: list[Combo] = []
    for chosen in itertools.product(*(v for _, v in axes)) if not only_workloads else ():
        picks = {k: v for (k, _), v in zip(axes, chosen)}
        origins = {k: f"matrix.{k}[{axes[i][1].index(v)}]" for i, (k, v) in enumerate(picks.items())}
        out.append(Combo(picks, origins, spec.tune))
    for j, ex in enumerate(spec.exclude):
        flat = flatten(ex)
        unknown = [k for k in flat if k not in spec.matrix]
        if unknown:
            raise UserError(f"keys {unknown} are not matrix axes; axes: {list(spec.matrix)}",
                            file=path, key=f"exclude[{j}]")
        kept = [c for c in out if not all(c.picks.get(k) == v for k, v in flat.items())]
        if len(kept) == len(out):
            raise UserError(f"matches no cell: {flat}", file=path, key=f"exclude[{j}]")
        out = kept
    for j, inc in enumerate(spec.include):
        flat = flatten({k: v for k, v in inc.items() if k != "tune"})
        tune, at = _include_tune(spec, inc, j, path)
        origins = {k: f"include[{j}].{k}" for k in flat}
        # A workload axis crosses every entry too: each method is run on each workload (tune.workloads)
        axes = [(k, v) for k, v in workloads if k not in flat]
        for chosen in itertools.product(*(v for _, v in axes)):
            picks = {**flat, **{k: v for (k, _), v in zip(axes, chosen)}}
            where = {**origins, **{k: f"matrix.{k}[{vs.index(picks[k])}]" for k, vs in axes}}
            out.append(Combo(picks, where, tune, at))
    if not out:
        raise UserError("every cell was excluded", file=path, key="exclude")
    return out


def _workload_axes(spec: MatrixFile) -> list[tuple[str, list[Any]]]:
    """The matrix axes the matrix-level tune: section names as workloads (tune.workloads), with their values."""
    names = spec.tune.workloads if spec.tune is not None else []
    return [(k, spec.matrix[k]) for k in names if k in spec.matrix]


def _include_tune(spec: MatrixFile, inc: dict, j: int, path: Path) -> tuple[TuneSpec | None, str]:
    """An include entry's search: its own `tune:` over the matrix-level one, none with `tune: false`."""
    if "tune" not in inc:
        return spec.tune, "tune"
    own, at = inc["tune"], f"include[{j}].tune"
    if own is False or own is None:
        return None, at
    if not isinstance(own, dict):
        raise UserError("a mapping (merged over the matrix-level tune section) or false", file=path, key=at)
    try:
        return TuneSpec.model_validate(merged(spec.tune, own)), at
    except ValidationError as e:
        raise explain(e, TuneSpec, file=path, where=lambda loc: ".".join((at, *map(str, loc)))) from None


def _combos(spec: MatrixFile, path: Path) -> list[tuple[dict[str, Any], dict[str, str]]]:
    """The cells' combinations: every combo that is no search (or a search's baseline), times the seeds, as
    (dotted overrides, dotted key -> where in the file set it)."""
    combos_ = [(c.picks, c.origins) for c in combos(spec, path) if c.tune is None or c.tune.baseline]
    if spec.seeds is None:
        return combos_
    if any("train.seed" in c[0] for c in combos_):
        raise UserError("set train.seed either in 'seeds' or in the matrix, not both", file=path, key="seeds")
    return [({**p, "train.seed": s}, {**o, "train.seed": f"seeds[{i}]"})
            for p, o in combos_ for i, s in enumerate(spec.seeds)]


def raw_cell(spec: MatrixFile, picks: dict[str, Any], sets: dict[str, Any] | None = None) -> dict:
    """base, then the combo's keys, then --set (a stand-in run of a study without editing its file): the cell as
    a raw mapping, before any check."""
    raw = copy.deepcopy(spec.base)
    for k, v in {**picks, **(sets or {})}.items():
        set_dotted(raw, k, v)
    return raw


def checked(raw: dict, path: Path, where: dict[str, str], label: str) -> CellConfig:
    """plan.cell_config, its problems explained against the file (`where`: dotted key -> place in the file)."""
    try:
        return plan.cell_config(raw)
    except plan.Invalid as e:
        def place(loc: tuple, o: dict[str, str] = where, lb: str = label) -> str:
            return _origin(loc, o) if loc else lb

        raise explain(e, CellConfig, file=path, where=place) from None


def _configs(spec: MatrixFile, path: Path, combos: list[tuple[dict[str, Any], dict[str, str]]],
             sets: dict[str, Any], errors: Errors) -> list[tuple[CellConfig, dict]]:
    """Each combination checked by the planner (errors name the place in the file, each once in `errors`); the
    same training and evaluation twice is one cell."""
    out, seen = [], set()
    for picks, origins in combos:
        where = {**origins, **{k: f"--set {k}" for k in sets}}
        label = "cell " + ", ".join(f"{k}={v}" for k, v in picks.items()) if picks else "base"
        try:
            config = checked(raw_cell(spec, picks, sets), path, where, label)
        except UserError as e:
            errors.add(e)
            continue
        key = (config.id(), config.eval.id(), config.checkpoint_eval_id(), config.checkpoint_steps())
        if key not in seen:
            seen.add(key)
            out.append((config, picks))
    return out


def expand(spec: MatrixFile, path: Path, sets: dict[str, Any] | None = None,
           errors: Errors | None = None) -> list[Cell]:
    own = Errors(path) if errors is None else errors
    cells = named(spec.name, _configs(spec, path, _combos(spec, path), sets or {}, own))
    if errors is None:
        own.raise_any()
    return cells


def named(name: str, configs: list[tuple[CellConfig, dict]]) -> list[Cell]:
    """Cells with their slugs and varying keys, from (config, the combo's keys)."""
    keys = list(dict.fromkeys(k for _, picks in configs for k in picks))
    values = [{k: get_dotted(config.model_dump(mode="json"), k) for k in keys} for config, _ in configs]
    varying = [k for k in keys if len({json.dumps(v[k], sort_keys=True) for v in values}) > 1]
    varying.sort(key=lambda k: k == "train.seed")  # the seed reads best last
    slug_keys = _slug_keys(varying, values)
    return [Cell(config=config, id=config.id(), varying={k: vals[k] for k in varying}, eval_id=config.eval.id(),
                 slug="-".join(_slug_part(k, vals[k]) for k in slug_keys) or name)
            for (config, _), vals in zip(configs, values)]


def _slug_keys(varying: list[str], values: list[dict]) -> list[str]:
    """The shortest leading run of varying keys that tells the cells apart (the seed always shows),
    so slugs stay readable when include entries vary many keys at once."""
    seed = [k for k in varying if k == "train.seed"]
    rest = [k for k in varying if k != "train.seed"]
    for n in range(len(rest) + 1):
        keys = rest[:n] + seed
        if len({json.dumps([v[k] for k in keys]) for v in values}) == len(values):
            return keys
    return varying
