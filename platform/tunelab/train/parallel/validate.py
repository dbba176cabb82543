"""Config-time checks of a layout: what each backend can run, said with the reason.

`check_parallel` sees only the `parallel` section (called by ParallelCfg's validator);
`check_cell` also sees the other sections (batch size, PEFT, optimizer) and is meant for
CellConfig's validator. Checks that need the model's shapes (layers per stage, heads per
tensor-parallel rank) run in `prepare`, where the model is at hand.
"""

from __future__ import annotations

# Optimizers that update parameters inside backward (under DeepSpeed in their own hooks: ds_fused.py; under
# pipeline schedules right after the schedule's backward: native.py).
FUSED_OPTIMIZERS = {"lomo", "adalomo"}


def _native(cfg) -> list[str]:
    errs = []
    if cfg.zero == 1:
        errs.append("zero: 1 (shard only the optimizer state) is not an FSDP2 mode: FSDP2 always shards "
                    "gradients and optimizer state; use zero: 2 (parameters stay gathered between forward "
                    "and backward) or zero: 3, or backend: deepspeed for ZeRO-1")
    if cfg.pp > 1 and cfg.pp_schedule in ("1f1b", "interleaved_1f1b") and cfg.microbatches < cfg.pp:
        errs.append(f"pp_schedule: {cfg.pp_schedule} needs microbatches >= pp (got microbatches "
                    f"{cfg.microbatches}, pp {cfg.pp}); raise microbatches or use pp_schedule: gpipe")
    if cfg.pp > 1 and cfg.pp_schedule == "interleaved_1f1b" and cfg.microbatches % cfg.pp:
        errs.append(f"pp_schedule: interleaved_1f1b needs microbatches to be a multiple of pp "
                    f"(got {cfg.microbatches} and {cfg.pp})")
    return errs


def _deepspeed(cfg) -> list[str]:
    errs = []
    if cfg.tp > 1 or cfg.pp > 1:
        errs.append(f"backend: deepspeed runs ZeRO data parallelism only (got tp {cfg.tp}, pp {cfg.pp}); "
                    "use backend: native for tensor and pipeline parallelism")
    return errs


BACKENDS = {"native": _native, "deepspeed": _deepspeed}


def check_parallel(cfg) -> None:
    errs = BACKENDS[cfg.backend](cfg)
    if cfg.pp == 1 and cfg.microbatches > 1:
        errs.append("microbatches splits a batch between pipeline stages and needs pp > 1; "
                    "use train.grad_accum for gradient accumulation")
    if errs:
        raise ValueError("; ".join(errs))


def check_cell(cell) -> None:
    """Cross-section checks; raises ValueError naming the keys. For CellConfig's model validator."""
    p, t = cell.parallel, cell.train
    errs = []
    rows = p.dp * (p.microbatches if p.pp > 1 else 1)
    if t.batch_size % rows:
        errs.append(f"train.batch_size {t.batch_size} must be divisible by parallel.dp x parallel.microbatches "
                    f"= {rows}: every data-parallel rank and pipeline chunk gets whole rows")
    fused = cell.optim.name in FUSED_OPTIMIZERS
    engine = p.dp * p.tp * p.pp > 1 or p.backend == "deepspeed"
    if cell.optim.name == "sophiag" and engine:
        errs.append("optim.name sophiag refreshes its Hessian estimate on the whole model between steps, which "
                    "the parallel engines do not call; run it on one process (parallel dp = tp = pp = 1)")
    if fused and p.backend == "deepspeed" and p.cpu_offload and p.zero < 3:
        errs.append(f"parallel.cpu_offload at zero {p.zero} offloads optimizer state, which optim.name "
                    f"{cell.optim.name} (nearly) lacks, so nothing would move; use zero: 3 (offloads the "
                    "weights) or drop cpu_offload")
    if errs:
        raise ValueError("; ".join(errs))
