"""What the plan cannot know and the run will check, said at `exp plan` so it is no surprise later.

The plan is the same on every machine (a laptop, a login node, the GPU box), so facts of the machine that
runs a cell wait for it: CUDA and its libraries, the contents of a hub model nobody has downloaded yet.
"""

from __future__ import annotations

from tunelab.core.config import CellConfig
from tunelab.core.registries import MODELS, PEFT
from tunelab.plan.sections import HUB_ID, looks_like_path


def run_time_checks(cfgs: list[CellConfig]) -> list[str]:
    """One line per kind of check the cells leave to the machine that runs them."""
    lines: dict[str, None] = {}
    for cfg in cfgs:
        name = cfg.model.name
        if name not in MODELS and not looks_like_path(name) and HUB_ID.match(name):
            lines[f"model.name {name!r}: that the hub (or its cache) has it, and its tokenizer"] = None
        if PEFT[cfg.peft.method].needs_cuda or cfg.train.device == "cuda":
            lines["a CUDA device (and bitsandbytes for qlora) on the machine that runs the cell"] = None
        if cfg.model.attn == "flash_attention_2":
            lines["flash-attn installed on the machine that runs the cell"] = None
        if any(t in ("mmlu", "gsm8k", "bbh") for t in cfg.eval.tasks):
            lines["each benchmark's test set (hub, cache or eval.data_dir): an unreachable one is reported "
                  "unavailable, not scored"] = None
    return list(lines)
