"""What `exp memory` predicts for a cell as configured, stored beside the measured peak (train/summary.json),
so every run checks the memory model and the memory study (experiments/paper_memory.yaml) prints both. The loop
asks for rows as long as the longest training row (`seq`): a batch is padded to its longest row, so that is the
longest step, and rows shorter than data.max_length (the quickstart's are about 100 tokens of 256) would
otherwise be predicted with activations the step never holds."""

from __future__ import annotations

from tunelab.core.registries import OPTIMIZERS
from tunelab.train.parallel.memory import Setup, estimate, estimate_group, shape_of

# Projection names -> the memory model's short names.
SHORT = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
         "down_proj": "down"}
ALL_LINEAR = ("q", "k", "v", "o", "gate", "up", "down")  # tunelab's LoRA default for Llama-like families


def setup_of(cell, dtype: str, seq: int | None = None) -> Setup | None:
    """The memory model's Setup for a cell, for rows of `seq` tokens (data.max_length when None); None where the
    model does not cover it (other PEFT methods, optimizers outside the registry, LoRA on modules it does not
    know)."""
    p, t = cell.parallel, cell.train
    if cell.optim.name not in OPTIMIZERS or cell.peft.method not in ("none", "lora"):
        return None
    targets: tuple[str, ...] = ALL_LINEAR
    if cell.peft.target_modules is not None:
        if any(m not in SHORT for m in cell.peft.target_modules):
            return None
        targets = tuple(SHORT[m] for m in cell.peft.target_modules)
    return Setup(optim=cell.optim.name, peft=cell.peft.method, lora_r=cell.peft.r, lora_targets=targets,
                 lora_dropout=cell.peft.dropout, dtype=dtype,
                 dp=p.dp, tp=p.tp, pp=p.pp, zero=p.zero, seq=seq or cell.data.max_length, batch=t.batch_size,
                 microbatches=p.microbatches, pp_schedule=p.pp_schedule,
                 activation_checkpointing=p.activation_checkpointing or t.gradient_checkpointing,
                 loss_chunk=t.loss_chunk)


def predicted_peak_mb(model_config, cell, dtype: str, seq: int | None = None) -> float | None:
    """Peak MB per device by the memory model (tensors only: no runtime, no allocator slack) for rows of `seq`
    tokens (data.max_length when None), or None."""
    s = setup_of(cell, dtype, seq)
    try:
        shape = shape_of(model_config)
    except AttributeError:  # not a Llama-like config the model can read
        return None
    return None if s is None else estimate(shape, s).peak / 2**20  # bytes -> MiB


def group_peak_mb(model_config, cells: list, dtype: str, seq: int | None = None, batched: bool = False,
                  ) -> float | None:
    """A together-group's peak MB on its device by the memory model (memory.estimate_group: tensors only), or None
    when the model does not cover one of its members (a method or optimizer it does not know)."""
    setups = [setup_of(c, dtype, seq) for c in cells]
    try:
        shape = shape_of(model_config)
    except AttributeError:
        return None
    if not setups or any(s is None for s in setups):
        return None
    return estimate_group(shape, [s for s in setups if s is not None], batched).peak / 2**20


def members_that_fit(model_config, cells: list, dtype: str, budget_mb: float, most: int, batched: bool = False,
                     ) -> int | None:
    """How many of these cells (in order) one group holds within `budget_mb` by the memory model, at least 1 and at
    most `most`; None when the model does not cover them."""
    n = 0
    for k in range(1, min(most, len(cells)) + 1):
        peak = group_peak_mb(model_config, cells[:k], dtype, batched=batched)
        if peak is None:
            return None
        if peak > budget_mb:
            break
        n = k
    return max(1, n)
