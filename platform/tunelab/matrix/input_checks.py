"""What a matrix's cells read besides their config, checked before anything runs where it can be known from
here: each recipe and its local files, and the model's tokenizer as far as the files on this machine tell
(its chat template when a recipe renders with `template: chat`; a hub model when the hub is switched off).
What only the machine that runs a cell can know, plan/later.py says it will check then.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tunelab.core import hub_access
from tunelab.core.config import CellConfig
from tunelab.core.errors import UserError
from tunelab.core.registries import MODELS
from tunelab.plan.sections import looks_like_path


def check(cfgs: list[CellConfig], file: Path) -> None:
    """UserError naming the matrix file and the key for the first input that cannot work."""
    from tunelab.data.recipe import check_files, load_recipe

    for name in dict.fromkeys(c.data.recipe for c in cfgs):
        try:
            check_files(name)
        except UserError as e:
            raise UserError(f"data.recipe {name!r}: {e}", file=file) from None
    seen = set()
    for cfg in cfgs:
        template = cfg.data.template or load_recipe(cfg.data.recipe)[0].template
        if (cfg.model, template) not in seen:
            seen.add((cfg.model, template))
            problem = _model_problem(cfg, template)
            if problem:
                raise UserError(problem, file=file, key="model.name")


def offline_problems(cfgs: list[CellConfig]) -> list[str]:
    """Hub models this machine cannot get: HF_HUB_OFFLINE is set and its cache lacks them. A fact of this
    machine, not of the plan: `exp plan` says it, `exp run` here refuses."""
    if not hub_access.offline():
        return []
    missing = dict.fromkeys(c.model.name for c in cfgs if c.model.name not in MODELS
                            and not looks_like_path(c.model.name) and not _hub_cached(c))
    return [f"model.name {name!r}: not in the Hugging Face cache, and HF_HUB_OFFLINE is set, so this machine "
            f"cannot download it: download it where the hub is reachable (`huggingface-cli download {name}`) into "
            f"this cache, or use a local folder path or a catalog alias ({', '.join(MODELS)})" for name in missing]


def _model_problem(cfg: CellConfig, template: str) -> str | None:
    name = cfg.model.name
    if template == "chat" and chat_template_of(cfg) is False:
        return (f"{name!r} has a tokenizer without a chat template, and recipe {cfg.data.recipe!r} renders its "
                "examples with `template: chat`; set data.template: alpaca (or plain), or use a model whose "
                f"tokenizer has one ({', '.join(n for n, a in MODELS.items() if a.chat_template)})")
    return None


def _hub_cached(cfg: CellConfig) -> bool:
    return hub_access.cached_hub_file(cfg.model.name, "config.json", cfg.model.revision) is not None


def chat_template_of(cfg: CellConfig) -> bool | None:
    """Whether the model's tokenizer has a chat template, read from its files without loading it; None when
    its files are not on this machine (the run checks it then)."""
    name = cfg.model.name
    if name in MODELS:
        return MODELS[name].chat_template
    if looks_like_path(name):
        folder = Path(name).expanduser()
        config, jinja = folder / "tokenizer_config.json", folder / "chat_template.jinja"
        if not config.is_file():
            return None
    else:
        found = hub_access.cached_hub_file(name, "tokenizer_config.json", cfg.model.revision)
        if found is None:
            return None
        config = Path(found)
        jinja_found = hub_access.cached_hub_file(name, "chat_template.jinja", cfg.model.revision)
        jinja = Path(jinja_found) if jinja_found else config.with_name("chat_template.jinja")
    try:
        has = bool(json.loads(config.read_text()).get("chat_template"))
    except (OSError, ValueError):
        return None
    return has or (jinja.is_file() and os.path.getsize(jinja) > 0)
