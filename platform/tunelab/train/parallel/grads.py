"""The global gradient norm over a model split by FSDP2, tensor and pipeline parallelism, and clipping.

Gradients of sharded parameters are DTensors on their own mesh (dp, tp or dp x tp); each mesh
group's norm is reduced by DTensor itself. Plain-tensor gradients are whole copies (replicated
across tp), counted once. Pipeline stages hold disjoint parameters: their squared norms add up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def global_norm(grads: list[torch.Tensor], pp_group=None, device="cpu") -> torch.Tensor:
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        sq = sq + norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(sq, group=pp_group)
    return sq.sqrt()


def clip_(grads: list[torch.Tensor], max_norm: float | None, pp_group=None, device="cpu",
          norm_of: list[torch.Tensor] | None = None) -> float:
    """Scale gradients so their global norm is at most max_norm; returns the norm before clipping.
    `norm_of`: the gradients that count in the norm, when some of `grads` are copies (tied weights)."""
    norm = float(global_norm(grads if norm_of is None else norm_of, pp_group, device))
    if max_norm is not None and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(coef)
    return norm
