"""Tied input and output embeddings under pipeline parallelism.

The embedding lives on the first stage and lm_head on the last, on different ranks. The last stage gets
its own copy of the shared weight. After each backward the two copies' gradients are summed between those
two ranks (the tied weight's gradient is the sum over both of its uses), so both copies take the same
update and stay equal, as Megatron-LM does with its embedding group. The copy is counted once in the
gradient norm, and its optimizer state is named after the embedding in checkpoints, so a checkpoint looks
the same as the one-process model's and loads under any layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tunelab.train.parallel.anatomy import Anatomy


def untie(stages: list, a: Anatomy) -> None:
    """Give the last stage's lm_head its own copy of the shared weight (before unused weights are freed)."""
    for st in stages:
        if st.parts.last and not st.parts.first:
            head = st.parts.lm_head
            head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)


def _pair_group(layout):
    """The group of this rank's first-stage and last-stage peers (same dp and tp coordinates)."""
    if layout.pp == 2:
        return layout.group("pp")
    ranks, mine = layout.mesh.mesh, None
    for i in range(layout.dp):
        for j in range(layout.tp):
            pair = [int(ranks[0, i, j]), int(ranks[-1, i, j])]
            group = dist.new_group(pair)  # every rank creates every group, in the same order
            if dist.get_rank() in pair:
                mine = group
    return mine


class TiedEmbeddings:
    def __init__(self, modules: list, a: Anatomy, layout):
        self.embed_name, self.head_name = f"{a.embed}.weight", f"{a.lm_head}.weight"
        self.params: list[torch.Tensor] = []  # this rank's share of the tie: the embedding, or the copy
        self.copy: torch.Tensor | None = None
        for m in modules:
            if m.parts.first:
                self.params.append(m.parts.embed.weight)
            elif m.parts.last:
                self.copy = m.parts.lm_head.weight
                self.params.append(self.copy)
        self.group = _pair_group(layout)

    def sum_grads(self) -> None:
        """Both copies get the sum of both uses' gradients (every rank holding one calls this)."""
        for p in self.params:
            if p.requires_grad:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g, group=self.group)
                p.grad = g

    def for_norm(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients without the copy's, which would count the tied weight twice."""
        if self.copy is None or self.copy.grad is None:
            return grads
        return [g for g in grads if g is not self.copy.grad]

    def rename_optim(self, osd: dict, to_checkpoint: bool) -> dict:
        """The copy's optimizer state under the embedding's name in checkpoints (and back when loading)."""
        if self.copy is None:
            return osd
        old, new = (self.head_name, self.embed_name) if to_checkpoint else (self.embed_name, self.head_name)
        state = {new if k == old else k: v for k, v in osd["state"].items()}
        groups = [{**g, "params": [new if n == old else n for n in g["params"]]} for g in osd["param_groups"]]
        return {"state": state, "param_groups": groups}
