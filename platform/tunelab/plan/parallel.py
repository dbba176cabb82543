"""Plan-time checks of a layout: what each backend can run, said with the reason.

Checks that need the model's shapes (layers per stage, heads per tensor-parallel rank) run in the engines,
where the model is at hand.
"""

from __future__ import annotations

from tunelab.config import ParallelCfg
from tunelab.errors import Problem
from tunelab.plan.optim import spec as optim_spec
from tunelab.registries import ENGINES


def _engine_limits(cfg: ParallelCfg) -> list[str]:
    """What the backend's registry entry says it cannot do."""
    engine, errs = ENGINES[cfg.backend], []
    unsupported = [d for d in ("tp", "pp") if getattr(cfg, d) > 1 and d not in engine.dims]
    if unsupported:
        errs.append(f"backend: {cfg.backend} runs {engine.runs} only (got "
                    f"{', '.join(f'{d} {getattr(cfg, d)}' for d in ('tp', 'pp'))}); use backend: native for tensor "
                    "and pipeline parallelism")
    if cfg.zero not in engine.zero:
        if cfg.backend == "native" and cfg.zero == 1:
            errs.append("zero: 1 (shard only the optimizer state) is not an FSDP2 mode: FSDP2 always shards "
                        "gradients and optimizer state; use zero: 2 (parameters stay gathered between forward "
                        "and backward) or zero: 3, or backend: deepspeed for ZeRO-1")
        else:
            errs.append(f"zero: {cfg.zero} is not a level of backend {cfg.backend} ({engine.zero})")
    return errs


def _schedule(cfg: ParallelCfg) -> list[str]:
    errs = []
    if cfg.pp > 1 and cfg.pp_schedule in ("1f1b", "interleaved_1f1b") and cfg.microbatches < cfg.pp:
        errs.append(f"pp_schedule: {cfg.pp_schedule} needs microbatches >= pp (got microbatches "
                    f"{cfg.microbatches}, pp {cfg.pp}); raise microbatches or use pp_schedule: gpipe")
    if cfg.pp > 1 and cfg.pp_schedule == "interleaved_1f1b" and cfg.microbatches % cfg.pp:
        errs.append(f"pp_schedule: interleaved_1f1b needs microbatches to be a multiple of pp "
                    f"(got {cfg.microbatches} and {cfg.pp})")
    if cfg.pp == 1 and cfg.microbatches > 1:
        errs.append("microbatches splits a batch between pipeline stages and needs pp > 1; "
                    "use train.grad_accum for gradient accumulation")
    return errs


def section(cfg: ParallelCfg) -> list[Problem]:
    errs = _engine_limits(cfg) + _schedule(cfg)
    return [Problem(("parallel",), "; ".join(errs))] if errs else []


def uses_engine(cell) -> bool:
    """Several processes, or DeepSpeed even on one: a parallel engine steps, not the one-process stepper."""
    p = cell.parallel
    return p.dp * p.tp * p.pp > 1 or p.backend != "native"


def across(cell) -> list[str]:
    """Cross-section checks, naming the keys."""
    p, t = cell.parallel, cell.train
    errs = []
    rows = p.dp * (p.microbatches if p.pp > 1 else 1)
    if t.batch_size % rows:
        errs.append(f"train.batch_size {t.batch_size} must be divisible by parallel.dp x parallel.microbatches "
                    f"= {rows}: every data-parallel rank and pipeline chunk gets whole rows")
    opt = optim_spec(cell.optim.name)
    if opt.refresh and uses_engine(cell):
        errs.append(f"optim.name {cell.optim.name} refreshes its Hessian estimate on the whole model between steps, "
                    "which the parallel engines do not call; run it on one process (parallel dp = tp = pp = 1)")
    if p.cpu_offload and not uses_engine(cell):
        errs.append("parallel.cpu_offload moves the state a parallel engine shards into CPU memory, and this cell "
                    "runs on one process without one, so it would be ignored; drop it, or use backend: deepspeed "
                    "(ZeRO offload works on one process) or dp > 1")
    if opt.fused and p.backend == "deepspeed" and p.cpu_offload and p.zero < 3:
        errs.append(f"parallel.cpu_offload at zero {p.zero} offloads optimizer state, which optim.name "
                    f"{cell.optim.name} (nearly) lacks, so nothing would move; use zero: 3 (offloads the "
                    "weights) or drop cpu_offload")
    return errs


def check_layout(cell) -> None:
    """For the engines: the same checks as at plan time, raising ValueError (a hand-built config skips plan)."""
    errs = [p.message for p in section(cell.parallel)] + across(cell)
    if errs:
        raise ValueError("; ".join(errs))
