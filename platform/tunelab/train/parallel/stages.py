"""Pipeline stages cut from a Hugging Face decoder.

A stage is a fresh module tree that holds only its own parts under their original paths
(`model.layers.3` stays `model.layers.3`), so parameter names, and hence distributed
checkpoints, are the same under every layout. Stage 0 also embeds; the last stage also
applies the final norm and lm_head (with its own copy of a tied embedding: tied.py). Between
stages travel the hidden states and the padding mask (every stage rebuilds the causal mask and
rotary embeddings for itself).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

from tunelab.core.errors import UserError
from tunelab.train.chunked import head_loss
from tunelab.train.loss import IGNORE
from tunelab.train.parallel import tied
from tunelab.train.parallel.anatomy import Anatomy


def _graft(root: nn.Module, path: str, module: nn.Module) -> None:
    """Attach `module` at dotted `path` under `root`, creating empty containers on the way."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        if not hasattr(node, name):
            node.add_module(name, nn.ModuleDict() if name == "layers" else nn.Module())
        node = getattr(node, name)
    node.add_module(leaf, module)


class Stage(nn.Module):
    def __init__(self, root: nn.Module, a: Anatomy, layer_ids: list[int], first: bool, last: bool):
        super().__init__()
        paths = [a.layers[i] for i in layer_ids] + [a.rotary]
        paths += [a.embed] if first else []
        paths += [a.norm, a.lm_head] if last else []
        self.paths = paths
        for p in paths:
            _graft(self, p, root.get_submodule(p))
        # Not registered as submodules: plain references for forward, no second name for a parameter.
        self.parts = SimpleNamespace(
            config=a.config, first=first, last=last, rotary=root.get_submodule(a.rotary),
            layers=[root.get_submodule(a.layers[i]) for i in layer_ids],
            embed=root.get_submodule(a.embed) if first else None,
            norm=root.get_submodule(a.norm) if last else None,
            lm_head=root.get_submodule(a.lm_head) if last else None)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor | None = None):
        """`targets` (the last stage): the shifted labels; the stage then returns the summed token loss at the
        labelled positions, the head and the loss in chunks (train/chunked.py), instead of the logits: as a
        1-element tensor, which the schedule can concatenate over micro-batches as it does outputs."""
        p = self.parts
        h = p.embed(x) if p.first else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rope = p.rotary(h, position_ids=pos)
        mask = create_causal_mask(config=p.config, inputs_embeds=h, attention_mask=attention_mask, cache=None,
                                  position_ids=pos)
        for layer in p.layers:
            h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=pos)
        if p.last and targets is not None:
            keep = targets != IGNORE
            return head_loss(p.lm_head, p.norm(h[keep]), targets[keep]).reshape(1)
        if p.last:
            return p.lm_head(p.norm(h))
        return h, attention_mask


def split_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    if n_layers % n_stages:
        raise UserError(f"the model's {n_layers} decoder layers do not split evenly into {n_stages} pipeline "
                        "stages; choose parallel.pp (x2 for interleaved_1f1b) dividing the layer count",
                        key="parallel.pp")
    k = n_layers // n_stages
    return [list(range(s * k, (s + 1) * k)) for s in range(n_stages)]


def build(root: nn.Module, a: Anatomy, stage_ids: list[int], n_stages: int) -> list[Stage]:
    """The stages `stage_ids` of `n_stages`; every other layer of `root` is moved to the meta
    device, so this process holds only its own stages' weights."""
    groups = split_layers(len(a.layers), n_stages)
    stages = [Stage(root, a, groups[s], first=s == 0, last=s == n_stages - 1) for s in stage_ids]
    if a.tied:
        tied.untie(stages, a)
    keep = {id(p) for st in stages for p in st.parameters()}
    for p in root.parameters():
        if id(p) not in keep:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # free it; never used here
    return stages
