"""Plan-time checks of the optimizer: the name, the constructor's arguments, and what it can train."""

from __future__ import annotations

from tunelab.core.config import CellConfig, OptimCfg
from tunelab.core.errors import Problem
from tunelab.core.registries import OptimizerSpec, accepts
from tunelab.core.registries import optimizer_spec as spec

# Set through their own keys in the optim section, never through optim.kwargs.
RESERVED = {"params": "the trainable parameters", "lr": "optim.lr", "weight_decay": "optim.weight_decay"}


def section(cfg: OptimCfg) -> list[Problem]:
    try:
        s = spec(cfg.name)
    except ValueError as e:
        return [Problem(("optim", "name"), str(e), cfg.name)]
    try:
        cls = s.load()
    except (ImportError, AttributeError) as e:  # e.g. muon on a torch without torch.optim.Muon
        return [Problem(("optim", "name"), f"optimizer {cfg.name!r} cannot be imported here: {e}", cfg.name)]
    msg = _args_problem(cfg, s, cls)
    return [Problem(("optim",), msg)] if msg else []


def _args_problem(cfg: OptimCfg, s: OptimizerSpec, cls) -> str | None:
    accepted, open_ended = accepts(cls)
    name = cfg.name
    if "model" in accepted and "params" not in accepted:
        # lomo_optim:Lomo and friends hook a whole model themselves; tunelab hands over parameters.
        return (f"optimizer {name!r} is built from a model, not from parameters, so tunelab cannot construct it; "
                "for LOMO and AdaLomo use optim.name: lomo or adalomo")
    for key in cfg.kwargs:
        if key in RESERVED:
            return f"optim.kwargs.{key}: set {RESERVED[key]} instead"
    unknown = [k for k in cfg.kwargs if k not in accepted] if not open_ended else []
    if unknown:
        allowed = sorted(accepted - set(RESERVED))
        return (f"optimizer {name!r} ({s.source}) takes no argument(s) {unknown} in optim.kwargs; "
                f"it takes: {', '.join(allowed) or 'nothing'}")
    if cfg.weight_decay and "weight_decay" not in accepted and not open_ended:
        return f"optimizer {name!r} ({s.source}) has no weight_decay; leave optim.weight_decay at 0"
    return None


def compatible(cfg: CellConfig) -> list[str]:
    """What an optimizer cannot train as configured.

    LOMO and AdaLomo apply each parameter's update during backward and free its gradient at once, so
    gradients of several micro-batches can never be summed; and they do fp32 math on fp32 or bf16 weights
    without the dynamic loss scaling fp16 weights would need.
    """
    name = cfg.optim.name
    if not spec(name).fused:
        return []
    out = []
    if cfg.train.grad_accum > 1:
        out.append(f"optim.name {name!r} updates each parameter inside backward and frees its gradient at once, "
                   f"so gradients of {cfg.train.grad_accum} micro-batches cannot be accumulated; set "
                   "train.grad_accum to 1 and raise train.batch_size instead")
    if cfg.model.dtype == "float16":
        out.append(f"optim.name {name!r} with model.dtype float16 would need dynamic loss scaling, which tunelab "
                   "does not implement; use bfloat16 or float32")
    return out
