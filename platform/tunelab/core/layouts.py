"""What a process layout can run, with the reason: the rules both the planner (plan/) and the engines
(train/parallel/steppers.prepare, for a config built by hand) apply. The facts of each engine are on its
registry entry (registries.EngineSpec).

Checks that need the model's shapes (layers per stage, heads per tensor-parallel rank) run in the engines,
where the model is at hand.
"""

from __future__ import annotations

from tunelab.core.config import CellConfig, ParallelCfg
from tunelab.core.errors import Problem
from tunelab.core.registries import ENGINES, optimizer_spec, uses_engine


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
    if cfg.backend not in ENGINES:
        return [Problem(("parallel", "backend"), ENGINES.unknown(cfg.backend), cfg.backend)]
    errs = ENGINES[cfg.backend].limits(cfg) + _schedule(cfg)
    return [Problem(("parallel",), "; ".join(errs))] if errs else []


def across(cfg: CellConfig) -> list[str]:
    """Cross-section checks, naming the keys."""
    p, t = cfg.parallel, cfg.train
    errs = []
    rows = p.dp * (p.microbatches if p.pp > 1 else 1)
    if t.batch_size % rows:
        errs.append(f"train.batch_size {t.batch_size} must be divisible by parallel.dp x parallel.microbatches "
                    f"= {rows}: every data-parallel rank and pipeline chunk gets whole rows")
    opt = optimizer_spec(cfg.optim.name)
    if opt.refresh and uses_engine(p):
        errs.append(f"optim.name {cfg.optim.name} refreshes its Hessian estimate on the whole model between steps, "
                    "which the parallel engines do not call; run it on one process (parallel dp = tp = pp = 1)")
    if p.cpu_offload and not uses_engine(p):
        errs.append("parallel.cpu_offload moves the state a parallel engine shards into CPU memory, and this cell "
                    "runs on one process without one, so it would be ignored; drop it, or use backend: deepspeed "
                    "(ZeRO offload works on one process) or dp > 1")
    if t.compile and uses_engine(p):
        errs.append("train.compile compiles the decoder body of a one-process step, and this cell runs under a "
                    "parallel engine (parallel dp x tp x pp > 1, or backend: deepspeed); set train.compile: false "
                    "or run on one process")
    if t.compile and opt.fused:
        errs.append(f"train.compile: optim.name {cfg.optim.name} updates each parameter inside backward as its "
                    "gradient arrives, which a compiled backward (every gradient at its end) would undo; set "
                    "train.compile: false or use another optimizer")
    engine = ENGINES[p.backend]
    if opt.fused and p.cpu_offload and p.zero < engine.offloads_weights_from_zero:
        errs.append(f"parallel.cpu_offload at zero {p.zero} offloads optimizer state, which optim.name "
                    f"{cfg.optim.name} (nearly) lacks, so nothing would move; use zero: "
                    f"{engine.offloads_weights_from_zero} (offloads the weights) or drop cpu_offload")
    return errs


def check_layout(cfg: CellConfig) -> None:
    """For the engines: the same checks as at plan time, raising ValueError (a hand-built config skips plan)."""
    errs = [p.message for p in section(cfg.parallel)] + across(cfg)
    if errs:
        raise ValueError("; ".join(errs))
