"""A cell folder's layout: one trained model, any number of evaluations of it.

    runs/<matrix>/<slug>-<id>/       id = CellConfig.id(): a hash of the training config only
      config.yaml cell.json status.json env.json cell.log train/ final/ checkpoints/
      eval/<eval-id>/results.json    eval-id = EvalCfg.id(): each evaluation config names its results
      eval/<eval-id>/samples.jsonl

So adding a task to a finished matrix evaluates the saved final/ weights again and trains nothing.
Folders of the first layout (the id hashed the eval section too, eval/results.json) are migrated on first
touch: `find` adopts them by the new id computed from their config.yaml.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from tunelab.config import CellConfig
from tunelab.store import cell_dirs, read_json, read_status, write_json

LAYOUT = 2  # cell.json "layout"; absent in folders of the first layout


def eval_dir(run_dir: Path, eval_id: str) -> Path:
    return run_dir / "eval" / eval_id


def is_trained(run_dir: Path) -> bool:
    """The training part is done and its final weights can be evaluated again."""
    return bool(read_status(run_dir).get("trained")) and (run_dir / "final").is_dir()


def eval_done(run_dir: Path, eval_id: str) -> bool:
    return bool((read_json(eval_dir(run_dir, eval_id) / "results.json") or {}).get("complete"))


def eval_results(run_dir: Path) -> list[tuple[str, dict]]:
    """Every evaluation of a cell, newest first: (eval id, results.json); a first-layout folder's
    eval/results.json has the id "eval"."""
    found = [(p, p.parent.name) for p in (run_dir / "eval").glob("*/results.json")]
    found += [(p, "eval") for p in [run_dir / "eval" / "results.json"] if p.is_file()]
    found.sort(key=lambda f: f[0].stat().st_mtime, reverse=True)
    return [(eval_id, res) for p, eval_id in found if (res := read_json(p)) is not None]


def results(run_dir: Path, eval_id: str | None = None) -> dict:
    """An evaluation's results.json: the one named, else the newest."""
    if eval_id is not None:
        return read_json(eval_dir(run_dir, eval_id) / "results.json") or {}
    return next((res for _, res in eval_results(run_dir)), {})


def find(matrix_dir: Path, cell_id: str) -> Path | None:
    """The folder of a trained-model id, adopting a first-layout folder whose config has that id."""
    metas = {d: read_json(d / "cell.json") or {} for d in cell_dirs(matrix_dir)}
    for d, meta in metas.items():
        if meta.get("layout") == LAYOUT and meta.get("id") == cell_id:
            return d
    for d, meta in metas.items():
        if meta.get("layout") != LAYOUT and _config_id(d) == cell_id:
            migrate(d)
            return d
    return None


def _config(run_dir: Path) -> CellConfig | None:
    try:
        return CellConfig.model_validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
    except Exception:  # noqa: BLE001 - a folder whose config no longer validates is not adopted
        return None


def _config_id(run_dir: Path) -> str | None:
    cfg = _config(run_dir)
    return cfg.id() if cfg else None


def migrate(run_dir: Path) -> bool:
    """First layout -> this one, in place: the evaluation moves under its eval id, cell.json takes the new id,
    and a done cell with final weights counts as trained. Each step is atomic and the whole is idempotent."""
    cfg = _config(run_dir)
    meta = read_json(run_dir / "cell.json") or {}
    if cfg is None or meta.get("layout") == LAYOUT:
        return False
    old = run_dir / "eval"
    target = eval_dir(run_dir, cfg.eval.id())
    status = read_status(run_dir)
    if (old / "results.json").is_file() and not target.exists():
        target.mkdir(parents=True)
        for name in ("samples.jsonl", "results.json"):  # results last: its presence means the move is done
            if (old / name).is_file():
                os.replace(old / name, target / name)
        res = read_json(target / "results.json") or {}
        if status.get("state") == "done" and not res.get("complete"):
            write_json(target / "results.json", {**res, "complete": True})
    if status.get("state") == "done" and (run_dir / "final").is_dir() and not status.get("trained"):
        write_json(run_dir / "status.json", {**status, "trained": True})
    write_json(run_dir / "cell.json", {**meta, "old_id": meta.get("id"), "id": cfg.id(), "layout": LAYOUT})
    return True
