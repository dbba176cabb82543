"""Which cells train together (#46): cells that share a frozen base run as one together-group, one process
(cell/group.py) holding the base once and each member's adapters beside it; the others run alone, and `why_alone`
says why. Pure planning: no torch, no model, nothing read but the configs.

A group's members share everything the base and its batches are made of, the grouping `key`: the model section,
the data section (recipe, order, max_length, packing), the batch shape (train.batch_size, grad_accum), precision,
device, gradient checkpointing and the process layout. What rides on the base is each member's own: seed, steps,
schedule, warmup, clipping, the optimizer and its settings, the PEFT method (LoRA, DoRA and IA3 mix: peft holds one
tuner type per model, so another type is injected beside it, train/members.py) and its settings (rank, alpha,
dropout, targets), loss_chunk, validation and checkpoint settings, the eval section, tracking. In exact mode (the
default) each member steps alone, in turn, with the shapes it has alone, so its numbers are the alone cell's bit for
bit.

How cells are grouped is a run setting (`exp run --together auto|N|off`, the matrix file's `run:` section), never
part of a cell's id. `auto` takes as many members as the device's memory fits by the memory model, at most
AUTO_MAX (train/parallel/predict.py, `group_peak_mb`); N at most N; off none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tunelab.core.config import CellConfig, content_id, world_size
from tunelab.core.errors import UserError
from tunelab.core.registries import PEFT, optimizer_spec, uses_engine
from tunelab.plan.sections import shared_ends

AUTO_MAX = 32  # members of one group at most under `auto`

MODES = ("exact", "batched")


@dataclass(frozen=True)
class Setting:
    """`--together` and `--together-mode` (or the matrix's `run:` section): off, auto, or at most N members."""

    together: str = "auto"  # auto | off | a number
    mode: str = "exact"

    @classmethod
    def parse(cls, together: str | int | None, mode: str | None,
              names: tuple[str, str] = ("--together", "--together-mode")) -> Setting:
        value = str(together if together is not None else "auto").strip().lower()
        if value not in ("auto", "off") and not (value.isdigit() and int(value) >= 1):
            raise UserError(f"{names[0]} {together!r}: allowed values are auto, off, or a number of members (1 or "
                            "more; 1 is off)")
        mode = mode or "exact"
        if mode not in MODES:
            raise UserError(f"{names[1]} {mode!r}: allowed values are {', '.join(MODES)}")
        return cls("off" if value == "1" else value, mode)

    @property
    def off(self) -> bool:
        return self.together == "off"

    def cap(self) -> int | None:
        """The most members of a group the setting allows (None: auto, by memory)."""
        return None if self.together == "auto" else 1 if self.off else int(self.together)


def key(cfg: CellConfig) -> str:
    """What a member shares with its group-mates: the base and how its batches are made (see the docstring)."""
    t = cfg.train
    shared = {"model": cfg.model.model_dump(mode="json"), "data": cfg.data.model_dump(mode="json"),
              "parallel": cfg.parallel.model_dump(mode="json"),
              "train": {"batch_size": t.batch_size, "grad_accum": t.grad_accum, "precision": t.precision,
                        "device": t.device, "gradient_checkpointing": t.gradient_checkpointing}}
    return content_id(shared)


def why_alone(cfg: CellConfig) -> str | None:
    """Why this cell cannot join a together-group whatever its company, in words (`exp plan`); None: it can."""
    spec = PEFT[cfg.peft.method]
    if spec.joins is None:
        return f"peft.method {cfg.peft.method}: {spec.alone_because}"
    if ends := shared_ends(cfg):
        return (f"peft.target_modules {ends}: the output head and the input embeddings are every member's, so no "
                "member's adapter can sit on them")
    n = world_size(cfg.parallel)
    if n > 1:
        return f"it runs on {n} processes (parallel): a group is one process"
    if uses_engine(cfg.parallel):
        return f"it steps under the {cfg.parallel.backend} engine: a group steps in one plain process"
    if cfg.train.compile:
        return "train.compile: one compiled body per model, and a group's members share theirs"
    ck = cfg.eval.checkpoints
    if ck is not None and ck.workers_on(cfg.train.device != "cpu") > 0:
        return ("its checkpoints are scored by evaluator processes beside training (eval.checkpoints.workers), "
                "each loading the base again; with workers: 0 they are scored in the group's process")
    if cfg.train.select is not None:
        return "train.select puts a chosen checkpoint's weights into the model after training (the base is shared)"
    return None


def why_not_batched(cfg: CellConfig) -> str | None:
    """Why this member of a group in batched mode steps exact instead (each with its own pass), in words; None: its
    rows can join the group's pass (train/batched.py). The model's own reasons (tuner layers, a base that draws
    random numbers) are found when it is loaded."""
    if cfg.data.pack:
        return "data.pack: packed rows carry a block mask per row and are not joined"
    if optimizer_spec(cfg.optim.name).fused:
        return f"optim.name {cfg.optim.name} updates inside its own backward pass"
    if cfg.train.gradient_checkpointing and cfg.peft.method in ("lora", "dora") and cfg.peft.dropout > 0:
        return ("gradient checkpointing with peft.dropout > 0: the recomputation would draw its dropout again from "
                "a member's stream that the pass has moved on")
    return None


@dataclass(frozen=True)
class Unit:
    """Cells that run in one process: a together-group (key set, two or more cells), or one cell alone and why."""

    cells: tuple
    key: str | None = None
    why: str | None = None

    @property
    def together(self) -> bool:
        return self.key is not None


NO_PARTNER = "no other cell of this run shares its base and batch shape"


def plan(cells: Sequence, setting: Setting, cap_of: Callable[[list], int] | None = None,
         alone: Callable[[Any], str | None] | None = None) -> list[Unit]:
    """The run's cells as units, in the order of their first cells; members in cell order. `cap_of(cells)`: how many
    of these cells (one key) fit one group under `auto` (the memory model); `alone(cell)`: a reason found at run
    time (a folder's state) besides the config's."""
    if setting.off:
        return [Unit((c,), why="--together off") for c in cells]
    reasons = {id(c): why_alone(c.config) or (alone(c) if alone else None) for c in cells}
    by_key: dict[str, list] = {}
    for c in cells:
        if reasons[id(c)] is None:
            by_key.setdefault(key(c.config), []).append(c)
    chunks: dict[int, Unit] = {}  # by the id of each unit's first cell
    for k, group in by_key.items():
        i, sizes = 0, list[int]()
        while i < len(group):  # each group sized on its own cells: later ones may have larger ranks or optimizers
            cap = max(1, setting.cap() or (cap_of(group[i:]) if cap_of else AUTO_MAX))
            part, i = tuple(group[i:i + cap]), i + cap
            if len(part) > 1:
                chunks[id(part[0])], sizes = Unit(part, k), sizes + [len(part)]
                continue
            chunks[id(part[0])] = Unit(part, why=_lone(len(group), sizes))
    units = []
    for c in cells:
        if reasons[id(c)] is not None:
            units.append(Unit((c,), why=reasons[id(c)]))
        elif id(c) in chunks:
            units.append(chunks[id(c)])
    return units


def _lone(cells: int, sizes: list[int]) -> str:
    """Why a cell that shares its key with others is a unit of its own."""
    if cells == 1:
        return NO_PARTNER
    if not sizes:
        return "one member at a time fits this machine's memory (the memory model)"
    return f"its base's other cells fill its groups ({' + '.join(map(str, sizes))} members)"


def describe(units: list[Unit], setting: Setting, searches: Sequence = ()) -> list[str]:
    """What `exp plan` says of the run's together-groups: each group's members, each cell alone and why; for a
    search's method groups (tune.plan.Group: slug, config), whether their trials join and with which others."""
    head = f"together ({setting.together}, {setting.mode})"
    out = []
    for n, u in enumerate([u for u in units if u.together], 1):
        out.append(f"{head}: group {n} ({len(u.cells)} members, one base): " + ", ".join(c.slug for c in u.cells))
        if setting.mode == "batched":
            out += [f"{head}: {c.slug} steps exact in its group: {why}" for c in u.cells
                    if (why := why_not_batched(c.config))]
    for u in units:
        if not u.together:
            out.append(f"{head}: {u.cells[0].slug} runs alone: {u.why}")
    by_key: dict[str, list[str]] = {}
    for g in searches:
        why = "--together off" if setting.off else why_alone(g.config)
        if why:
            out.append(f"{head}: search {g.slug}'s trials run alone: {why}")
        else:
            by_key.setdefault(key(g.config), []).append(g.slug)
            if setting.mode == "batched" and (why := why_not_batched(g.config)):
                out.append(f"{head}: search {g.slug}'s trials step exact in their groups: {why}")
    for named in by_key.values():
        slugs = list(dict.fromkeys(named))  # a search's studies: named once
        out.append(f"{head}: the trials of search{'es' * (len(slugs) > 1)} {', '.join(slugs)} train together at "
                   "each rung (one base; a promoted trial goes on in memory)")
    return list(dict.fromkeys(out))  # (a search's studies say the same once)
