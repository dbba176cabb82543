"""Tensor parallelism: per-family plans applied with `parallelize_module`, LoRA-aware.

The plan says, per linear layer of a decoder layer, whether its output features are split
(colwise: q, k, v, gate, up) or its input features (rowwise: o, down), Megatron style: one
all-reduce after attention and one after the MLP. Embedding and lm_head stay replicated, so the
loss sees whole logits. Attention needs no head-count change: transformers reshapes q/k/v with
`view(..., -1, head_dim)`, which finds the local heads, and the query/key-value group ratio is
the same on every rank.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from tunelab.core.errors import UserError

# Our plan for families whose config carries none; keys are relative to the decoder (`model.model`).
_LLAMA_LIKE = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
}
FAMILY_PLANS: dict[str, dict[str, str]] = {"llama": _LLAMA_LIKE, "qwen2": _LLAMA_LIKE, "mistral": _LLAMA_LIKE}


def _lora_styles(path: str, module: Any, kind: str) -> dict[str, ParallelStyle]:
    """A LoRA-wrapped linear: the frozen base layer is split as planned; of the adapter, the
    matrix touching the split dimension is split the same way and the other stays replicated."""
    base = ColwiseParallel() if kind == "colwise" else RowwiseParallel()
    styles: dict[str, ParallelStyle] = {f"{path}.base_layer": base}
    for adapter in module.lora_A:
        if kind == "colwise":  # x (whole) -> A (replicated) -> B (output features split)
            styles[f"{path}.lora_B.{adapter}"] = ColwiseParallel()
        else:  # x (split) -> A (input features split, all-reduced) -> B (replicated)
            styles[f"{path}.lora_A.{adapter}"] = RowwiseParallel()
    return styles


def family_plan(config) -> dict[str, str]:
    """The model's own `base_model_tp_plan` when transformers ships one in our vocabulary, else ours."""
    own = getattr(config, "base_model_tp_plan", None) or {}
    if own and set(own.values()) <= {"colwise", "rowwise"}:
        return dict(own)
    plan = FAMILY_PLANS.get(getattr(config, "model_type", ""))
    if plan is None:
        raise UserError(f"no tensor-parallel plan for model type {config.model_type!r}; known: "
                        f"{', '.join(sorted(FAMILY_PLANS))} (or a config with a colwise/rowwise "
                        "base_model_tp_plan)", key="parallel.tp")
    return plan


def check_divisible(config, tp: int) -> None:
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if heads % tp or kv % tp or config.intermediate_size % tp:
        raise UserError(f"parallel.tp {tp} must divide the attention heads ({heads}), the key-value heads ({kv}) "
                        f"and the MLP width ({config.intermediate_size}) of this model", key="parallel.tp")


def apply(root: nn.Module, decoder_path: str, config, tp_mesh) -> None:
    """Split the linear layers of every decoder layer under `root` across `tp_mesh`."""
    check_divisible(config, tp_mesh.size())
    plan = family_plan(config)
    prefix = f"{decoder_path}." if decoder_path else ""
    styles: dict[str, ParallelStyle] = {}
    for name, module in root.named_modules():
        rel = name[len(prefix):] if name.startswith(prefix) else None
        kind = next((k for pat, k in plan.items() if rel is not None and fnmatch.fnmatchcase(rel, pat)), None)
        if kind is None:
            continue
        if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
            styles.update(_lora_styles(name, module, kind))
        elif isinstance(module, nn.Linear):
            styles[name] = ColwiseParallel() if kind == "colwise" else RowwiseParallel()
    if not styles:
        raise UserError("the tensor-parallel plan matched no linear layer of this model", key="parallel.tp")
    parallelize_module(root, tp_mesh, styles)
