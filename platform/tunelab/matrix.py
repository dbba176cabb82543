"""Matrix files -> resolved cells, each checked by tunelab.plan.

A cell's id is a short hash of its training config (CellConfig.id: the folder of the trained model); its
eval_id one of its eval section (EvalCfg.id: the results of one evaluation of that model).
"""

from __future__ import annotations

import copy
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tunelab import inputs, plan
from tunelab.config import CellConfig, world_size
from tunelab.errors import UserError, explain, load_yaml
from tunelab.tune.spec import TuneSpec, merged

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
    tune: TuneSpec | None = Field(None, description="search these keys per method group with the same budget "
                                  "(docs/tuning.md); an include entry's own `tune:` goes over it, `tune: false` "
                                  "leaves the entry untuned")


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


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{'optim': {'lr': 1}} -> {'optim.lr': 1}; dotted keys pass through."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and "." not in key:  # sections are one level deep
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def set_dotted(d: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for p in parents:
        nxt = d.setdefault(p, {})
        if not isinstance(nxt, dict):
            nxt = d[p] = {}
        d = nxt
    d[last] = copy.deepcopy(value)


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


def load(path: str | Path, sets: dict[str, Any] | None = None) -> tuple[MatrixFile, list[Cell]]:
    """The cells of a matrix file; `sets` (from --set) override every cell's keys, matrix axes included."""
    path = Path(path)
    raw = load_yaml(path)
    if not isinstance(raw, dict):
        raise UserError("a matrix file is a mapping with keys name, base, matrix, include, exclude, seeds",
                        file=path)
    try:
        spec = MatrixFile.model_validate(raw)
    except ValidationError as e:
        raise explain(e, MatrixFile, file=path) from None
    sets = dict(sets or {})
    spec = _matrix_sets(spec, sets, path)
    cells = expand(spec, path, sets)
    inputs.check([c.config for c in cells], path)
    return spec, cells


def cell_sets(sets: dict[str, Any] | None) -> dict[str, Any]:
    """The --set keys that go to every cell: all but the matrix-level ones (`seeds`, `tune.*`)."""
    return {k: v for k, v in (sets or {}).items() if k != "seeds" and not k.startswith("tune.")}


def _matrix_sets(spec: MatrixFile, sets: dict[str, Any], path: Path) -> MatrixFile:
    """The matrix-level keys --set may change (a smaller stand-in of a study): `seeds` and the keys of the
    matrix-level `tune:` section (tune.trials, tune.min_steps, ...). They are taken out of `sets`."""
    changes: dict[str, Any] = {}
    if "seeds" in sets:
        changes["seeds"] = sets.pop("seeds")
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
    out: list[Combo] = []
    for chosen in itertools.product(*(v for _, v in axes)):
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
        out.append(Combo(flat, {k: f"include[{j}].{k}" for k in flat}, tune, at))
    if not out:
        raise UserError("every cell was excluded", file=path, key="exclude")
    return out


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
             sets: dict[str, Any]) -> list[tuple[CellConfig, dict]]:
    """Each combination checked by the planner (errors name the place in the file); the same training and
    evaluation twice is one cell."""
    out, seen = [], set()
    for picks, origins in combos:
        where = {**origins, **{k: f"--set {k}" for k in sets}}
        label = "cell " + ", ".join(f"{k}={v}" for k, v in picks.items()) if picks else "base"
        config = checked(raw_cell(spec, picks, sets), path, where, label)
        key = (config.id(), config.eval.id(), config.checkpoint_eval_id(), config.checkpoint_steps())
        if key not in seen:
            seen.add(key)
            out.append((config, picks))
    return out


def expand(spec: MatrixFile, path: Path, sets: dict[str, Any] | None = None) -> list[Cell]:
    return named(spec.name, _configs(spec, path, _combos(spec, path), sets or {}))


def named(name: str, configs: list[tuple[CellConfig, dict]]) -> list[Cell]:
    """Cells with their slugs and varying keys, from (config, the combo's keys)."""
    keys = list(dict.fromkeys(k for _, picks in configs for k in picks))
    values = [{k: _get(config.model_dump(mode="json"), k) for k in keys} for config, _ in configs]
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


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj
