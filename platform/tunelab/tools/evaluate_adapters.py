"""`exp eval run BASE --adapters CELL...`: finished PEFT cells of one base evaluated together.

The base loads once; each cell's final/ adapter is loaded beside it, unmerged (train.peft.load_adapters: LoRA, DoRA
and IA3, several types on one base); evals.run_together scores every request of all of them in shared passes and
writes each cell's results into that cell's eval/<eval-id>/, as the cell's own evaluation (`exp run`) writes them:
its eval section (or the one the command line gives every cell), its validation and training sets, the validation
loss its training measured when that is what the section asks. Each cell is worked in under its folder's lock;
every refusal comes before anything is loaded or written.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from tunelab.core.config import CellConfig, EvalCfg
from tunelab.core.errors import UserError
from tunelab.core.events import Emit, ignore
from tunelab.folders.cell import CellFolder, open_cell
from tunelab.plan.sections import shared_ends

ROUTED = ("lora", "dora", "ia3")  # the methods whose adapters share passes over one base (evals/engine/route.py)


def check(base: str, paths: list[Path], ecfg: EvalCfg | None) -> tuple[list[CellFolder], list[CellConfig], EvalCfg]:
    """The cells, their configs and the eval section they are scored with; UserError for a cell that is not a
    trained LoRA/DoRA/IA3 cell of `base`, cells that differ in their model, or (without `ecfg`) in their eval
    section."""
    from tunelab.models.loading import resolve

    folders: list[CellFolder] = []
    cfgs: list[CellConfig] = []
    for path in paths:
        folder = open_cell(path.expanduser())
        cfg = folder.config()
        if cfg.peft.method not in ROUTED:
            raise UserError(f"a {cfg.peft.method} cell: --adapters evaluates {', '.join(ROUTED)} adapters over one "
                            "base (their layers route each row to its adapter); evaluate this cell on its own "
                            "(`exp run` of its matrix)", file=folder.path, key="peft.method")
        if ends := shared_ends(cfg):
            raise UserError(f"its adapter adapts {ends}: the output head and the input embeddings are the base's, "
                            "shared by every adapter of a shared pass; evaluate this cell on its own (`exp run` of "
                            "its matrix)", file=folder.path, key="peft.target_modules")
        if not folder.is_trained():
            raise UserError("the cell has no trained final/ adapter yet (see `exp status`); nothing to evaluate",
                            file=folder.path)
        if resolve(cfg.model.name) != resolve(base):
            raise UserError(f"the cell's base model is {cfg.model.name!r}, not {base!r}: --adapters evaluates cells "
                            "of the one base the command names", file=folder.path, key="model.name")
        if cfgs and cfg.model != cfgs[0].model:
            raise UserError(f"the cell's model section {cfg.model.model_dump(exclude_defaults=True)} differs from "
                            f"{folders[0].path}'s {cfgs[0].model.model_dump(exclude_defaults=True)}: cells evaluated "
                            "together load one base the same way", file=folder.path, key="model")
        if folder.path.resolve() in [f.path.resolve() for f in folders]:  # (one cell written two ways too)
            raise UserError("the cell is named twice", file=folder.path)
        folders.append(folder)
        cfgs.append(cfg)
    if ecfg is None:
        ids = {cfg.eval.id() for cfg in cfgs}
        if len(ids) > 1:
            raise UserError("the cells' eval sections differ (" + ", ".join(
                f"{f.label}: {c.eval.id()}" for f, c in zip(folders, cfgs)) + "); evaluated together they share one: "
                "give it with --suite or --tasks, or evaluate each group of cells with one eval section apart")
        ecfg = cfgs[0].eval
    return folders, cfgs, ecfg


@contextlib.contextmanager
def _locked(folders: list[CellFolder]):
    with contextlib.ExitStack() as stack:
        for folder in folders:
            held = folder.lock()
            if not held.acquire(wait=0):
                raise UserError(f"the cell is in use ({folder.lock_holder()}); try again once it is free",
                                file=folder.path)
            stack.enter_context(held)
        yield


def evaluate(base: str, paths: list[Path], ecfg: EvalCfg | None, device: str,
             emit: Emit = ignore) -> list[tuple[CellFolder, Path, dict]]:
    """Every cell's final/ adapter over one load of `base`, scored together into each cell's eval/<eval-id>/ ->
    [(cell, its eval folder, results)]."""
    from tunelab import evals
    from tunelab.checkpoint_scores import evaluate as saved
    from tunelab.machine import runtime
    from tunelab.machine.runtime import Layout
    from tunelab.models import loading
    from tunelab.train import peft

    folders, cfgs, ecfg = check(base, paths, ecfg)
    with _locked(folders):
        rt = runtime.resolve(cfgs[0], Layout(device=runtime.device_of(device)))
        model, _ = loading.load(cfgs[0].model, rt)
        tokenizer = _tokenizer(folders[0])  # the cells' own, saved in final/ (one base: one tokenizer)
        names = [f"cell{k}" for k in range(len(folders))]
        model = peft.load_adapters(model, [f.final for f in folders], names)
        data: dict[str, Any] = {}  # cells of one data section build it once
        contexts = []
        for folder, cfg in zip(folders, cfgs):
            datasets = None
            if saved.needs_data(ecfg):
                key = cfg.data.model_dump_json()
                datasets = data[key] = data.get(key) or saved.cell_data(cfg, tokenizer)
            contexts.append(saved.context(folder, folder.eval_dir(ecfg.id()), datasets, _trained_val_loss(folder, cfg,
                                                                                                          ecfg)))
        outs = evals.run_together(model, tokenizer, ecfg, contexts, names, emit)
    return [(f, c.out_dir, o) for f, c, o in zip(folders, contexts, outs)]


def _tokenizer(folder: CellFolder) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder.final)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _trained_val_loss(folder: CellFolder, cfg: CellConfig, ecfg: EvalCfg) -> float | None:
    """The validation loss training measured, when it was measured as `ecfg` asks on the weights final/ holds (not
    when a selection put another step's there): what the cell's own evaluation reports (cell/evaluation.py)."""
    from tunelab.train.validation import Validation

    summary = folder.summary()
    same = summary.get("validation") == Validation.of(ecfg).settings() and \
        folder.selection().get("step", cfg.train.steps) == cfg.train.steps
    return summary.get("val_loss") if same else None
