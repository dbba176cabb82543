"""Muon for the hidden weight matrices, AdamW for everything else: one optimizer object for the loop.

torch.optim.Muon (orthogonalized momentum through Newton-Schulz iterations) only accepts 2D parameters,
and its authors (Jordan et al. 2024; Moonlight, Liu et al. 2025) recommend it for hidden linear maps only:
embeddings, the output head and every vector (norm weights, biases) stay on AdamW. adjust_lr_fn defaults
to "match_rms_adamw" (Moonlight's scaling) so that one `optim.lr` suits both halves.

Which 2D parameters are embeddings or the head is read from their names when the loop passes
(name, parameter) pairs; given bare tensors, matrices whose first dimension is the largest one seen (the
vocabulary) are taken for embeddings and head.
"""

from __future__ import annotations

import torch

from tunelab.optimizers.closure import evaluate

# Name fragments of 2D parameters that are lookup tables or the output head, not hidden linear maps.
NOT_HIDDEN = ("embed", "lm_head", "wte", "wpe")


def split_hidden(params) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(hidden 2D matrices for Muon, everything else for AdamW)."""
    items = list(params)
    named = [it if isinstance(it, tuple) else (None, it) for it in items]
    vocab = max((p.shape[0] for _, p in named if p.ndim == 2), default=None)

    def hidden(name: str | None, p: torch.Tensor) -> bool:
        if p.ndim != 2:
            return False
        if name is not None:
            return not any(k in name for k in NOT_HIDDEN)
        return p.shape[0] != vocab

    muon = [p for n, p in named if hidden(n, p)]
    ids = {id(p) for p in muon}
    return muon, [p for _, p in named if id(p) not in ids]


class MuonAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.0, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
                 ns_steps: int = 5, adjust_lr_fn: str | None = "match_rms_adamw",
                 adamw_betas: tuple[float, float] = (0.9, 0.999), adamw_eps: float = 1e-8):
        muon_params, adamw_params = split_hidden(params)
        self.parts: dict[str, torch.optim.Optimizer] = {}
        if muon_params:
            self.parts["muon"] = torch.optim.Muon(
                muon_params, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                ns_coefficients=ns_coefficients, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        if adamw_params:
            self.parts["adamw"] = torch.optim.AdamW(adamw_params, lr=lr, weight_decay=weight_decay,
                                                    betas=adamw_betas, eps=adamw_eps)
        super().__init__(muon_params + adamw_params, dict(lr=lr, weight_decay=weight_decay))
        self._share_groups()

    def _share_groups(self) -> None:
        # The very group dicts of the parts: an LR scheduler writing group["lr"] drives both.
        self.param_groups = [g for part in self.parts.values() for g in part.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate(closure)
        for part in self.parts.values():
            part.step()
        return loss

    def state_dict(self) -> dict:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state_dict: dict) -> None:
        for name, part in self.parts.items():
            part.load_state_dict(state_dict[name])
        self._share_groups()
