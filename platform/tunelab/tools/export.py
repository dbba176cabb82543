"""`exp export CELL_DIR --out DIR [--merge]`: a finished cell as a Hugging Face folder.

Three kinds of folder: `full` (a full-parameter cell: its weights), `merged` (a LoRA/DoRA/IA3 cell with
--merge: the adapter folded into the base weights, loadable by plain transformers), `adapter` (a PEFT cell
without --merge, or a prompt-learning method that cannot merge: the adapter, which needs peft to load).
Each has the tokenizer, a README.md model card and tunelab_export.json (what `exp chat` reads back).

The folder is built in a temp sibling and renamed into place, so a failed or killed export leaves nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tunelab import __version__
from tunelab.core.errors import UserError
from tunelab.core.files import read_json, write_json, write_text
from tunelab.core.registries import PEFT
from tunelab.data.recipe import trained_template
from tunelab.folders.cell import CellFolder, open_finished

DTYPES = ("auto", "float32", "bfloat16", "float16")
# Methods whose adapter peft can fold into the base weights; prompt-learning ones add virtual tokens instead.
MERGEABLE = tuple(n for n, p in PEFT.items() if n != "none" and not p.prompt_learning)
ADAPTER_NOTE = ("this is a {method} adapter, not a full model: it needs the `peft` package and the base model "
                "`{base}` to load{why}.")


def plan_kind(cell: CellFolder, merge: bool) -> tuple[str, list[str]]:
    """(kind, notes for the card and the console)."""
    if cell.method == "none":
        return "full", []  # --merge has nothing to fold: every weight was trained
    if merge and cell.method in MERGEABLE:
        notes = []
        if cell.method == "qlora":
            notes.append("the cell trained its adapter over a 4-bit base; it was merged into the unquantized base, "
                         "so outputs differ from the cell's by the 4-bit rounding.")
        return "merged", notes
    if cell.method in MERGEABLE:
        why = "; pass --merge to fold it into the base weights"
    else:
        why = (f"; {cell.method} learns virtual tokens, which cannot be merged into the weights"
               + (", so --merge does not apply" if merge else ""))
    return "adapter", [ADAPTER_NOTE.format(method=cell.method, base=cell.base, why=why)]


def _replace_atomically(out: Path, build: Callable[[Path], None]) -> None:
    """Build in a temp sibling, then rename over `out` (the old folder, with --force, goes only after)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    old = None
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700, and some writers 0600 files; an export is meant to be shared
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out.exists():
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
            os.replace(out, old / out.name)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _torch_dtype(name, default):
    """A dtype name (or torch.dtype) -> torch.dtype; "auto" -> default."""
    import torch

    name = default if name == "auto" else name
    return getattr(torch, name) if isinstance(name, str) else name


def _base_source(cell: CellFolder) -> str:
    from tunelab.models.loading import resolve

    try:
        return resolve(cell.base)
    except Exception as e:  # noqa: BLE001 - a catalog alias that cannot be built here (offline, no pip)
        raise UserError(f"could not materialize the base model {cell.base!r}: {type(e).__name__}: {e}",
                        file=cell.config_file, key="model.name") from None


def _load_base(cell: CellFolder, source: str, dtype):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(source, revision=cell.raw_config()["model"].get("revision"),
                                                    dtype=dtype)
    except OSError as e:
        raise UserError(f"could not load the base model {cell.base!r} (from {source}): {e}",
                        file=cell.config_file, key="model.name") from None


def _save_model(model, tok, dest: Path) -> None:
    from transformers import GenerationConfig

    model.config.use_cache = True  # training may have turned it off for gradient checkpointing
    gen = model.generation_config or GenerationConfig.from_model_config(model.config)
    if gen.eos_token_id is None:
        gen.eos_token_id = tok.eos_token_id
    if gen.pad_token_id is None:
        gen.pad_token_id = tok.pad_token_id
    model.generation_config = gen
    model.save_pretrained(dest)  # safetensors, config.json, generation_config.json
    tok.save_pretrained(dest)


def export_cell(cell_dir: Path, out: Path, *, merge: bool = False, dtype: str = "auto", force: bool = False,
                log: Callable[[str], None] = lambda _: None) -> tuple[str, list[str]]:
    """Write the export; returns (kind, notes). Every refusal is a UserError raised before anything is written."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: allowed are {', '.join(DTYPES)} (auto keeps the stored dtype)")
    cell = open_finished(cell_dir, "export")
    out = out.expanduser()
    if out.exists() and not force:
        raise UserError("already exists; choose another --out or pass --force to replace it", file=out)
    if out.resolve() == cell.path.resolve() or cell.path.resolve() in out.resolve().parents:
        raise UserError("--out must be outside the cell folder", file=out)
    kind, notes = plan_kind(cell, merge)
    template = trained_template(cell.raw_config())
    base_path = cell.base

    def build(tmp: Path) -> None:
        nonlocal base_path
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(cell.final)
        if kind == "full":
            log(f"loading {cell.final}")
            model = AutoModelForCausalLM.from_pretrained(cell.final, dtype="auto" if dtype == "auto" else dtype)
            _save_model(model, tok, tmp)
        elif kind == "merged":
            import torch
            from peft import PeftModel
            from transformers import AutoConfig

            base_path = _base_source(cell)
            revision = cell.raw_config()["model"].get("revision")
            stored = getattr(AutoConfig.from_pretrained(base_path, revision=revision), "dtype", None) or torch.float32
            log(f"loading the base {cell.base} ({base_path}) in float32 and merging the {cell.method} adapter")
            # Merge in float32 whatever the stored dtype, then cast once: no double rounding of the update.
            base = _load_base(cell, base_path, torch.float32)
            merged = PeftModel.from_pretrained(base, cell.final).merge_and_unload()
            _save_model(merged.to(_torch_dtype(dtype, stored)), tok, tmp)
        else:
            for f in cell.final.iterdir():
                if f.is_file() and f.name != "README.md":  # peft's README is an empty template; ours replaces it
                    shutil.copy2(f, tmp / f.name)
            base_path = (read_json(cell.final / "adapter_config.json", dict) or {}).get("base_model_name_or_path") \
                or cell.base
        from tunelab.tools import modelcard

        write_text(tmp / "README.md", modelcard.render(cell, kind, base_path=base_path, template=template,
                                                      notes=notes))
        write_json(tmp / "tunelab_export.json", {
            "cell": cell.title, "cell_id": cell.meta().get("id"), "cell_dir": str(cell.path.resolve()),
            "kind": kind, "peft_method": cell.method, "base_model": cell.base, "template": template,
            "dtype": dtype, "exported_at": time.time(), "tunelab": __version__})

    _replace_atomically(out, build)
    return kind, notes
