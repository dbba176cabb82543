"""A search's trials and its winner's retraining, as ordinary cells.

A trial is the group's cell with the sampled values and, as its evaluation, only the objective's task (and, when a
search ranks its rungs by a checkpoint score, that task on the checkpoints of its rungs): its own content hash,
folder, lock, resume and W&B run. It trains with the matrix's first seed, so the winner retrained
with that seed is the same cell (same id, same folder): it is only evaluated on the suite, not trained again.
"""

from __future__ import annotations

import copy
from typing import Any

from tunelab import plan
from tunelab.core.config import CellConfig
from tunelab.core.keys import set_dotted
from tunelab.matrix.expansion import Cell
from tunelab.tune.plan import Group, trial_raw


def _config(group: Group, params: dict[str, Any], seed: int, trial: int | None) -> CellConfig:
    """The group's cell with `params` and `seed`; a trial's (`trial` its number) evaluates the objective only."""
    raw = copy.deepcopy(group.raw) if trial is None else trial_raw(group.raw, group.spec, group.schedule, trial)
    for key, value in params.items():
        set_dotted(raw, key, value)
    set_dotted(raw, "train.seed", seed)
    return plan.cell_config(raw)  # the bounds were checked at plan time; a value between them is as valid


def trial_cell(group: Group, number: int, params: dict[str, Any], stop_at: int | None = None) -> Cell:
    config = _config(group, params, group.seeds[0], number)
    meta = {"tune": {"role": "trial", "group": group.slug, "study": group.study, "trial": number}}
    return Cell(config, config.id(), f"{group.slug}{group.tag}-t{number:02d}", {**group.varying, **params},
                config.eval.id(),
                stop_at=stop_at, meta=meta)


def final_cells(group: Group, params: dict[str, Any], summary: dict[str, Any]) -> list[Cell]:
    """The winner, once per seed of the matrix, evaluated as the matrix says (its suite). With several studies
    each study's winner is retrained (the row is the median over them)."""
    out = []
    for seed in group.seeds:
        config = _config(group, params, seed, None)
        suffix = group.tag + (f"-s{seed}" if len(group.seeds) > 1 else "")
        varying = {**group.varying, **params, **({"train.seed": seed} if len(group.seeds) > 1 else {})}
        out.append(Cell(config, config.id(), f"{group.slug}-tuned{suffix}", varying, config.eval.id(),
                        meta={"tune": {"role": "tuned", **summary}}))
    return out
