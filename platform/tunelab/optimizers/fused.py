"""Update-in-backward machinery shared by LOMO and AdaLomo.

Each trainable parameter gets a post-accumulate-grad hook. The moment autograd has finished that
parameter's gradient, the hook applies the subclass's update and drops the gradient, so at no time do
the gradients of the whole model exist together (the saving LOMO is about). Global gradient-norm
clipping needs the norm before the first update, hence the papers' two backward passes over one graph:
the first only measures, the second updates with the clip coefficient.

The training loop calls `fused_step(closure)` instead of backward + clip + step. Engines that run
backward themselves (pipeline schedules, where a gradient is complete only after the last micro-batch)
call `step(grad_norm=...)` after it: the same update from the accumulated `.grad`, one parameter at a time,
each gradient freed as soon as it is used.

Sharded parameters (FSDP2, tensor parallel) are DTensors: each parameter's norm is made whole with
`full_tensor()` (a collective, run in the same order on every rank since all ranks run the same graph),
so the global norm is one plain number whatever mesh each parameter lives on.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

Closure = Callable[[], torch.Tensor]


class EngineHooks:
    """What a parallel engine adds around each in-backward update (DeepSpeed: parallel/ds_fused.py)."""

    reforward = False  # with clipping: the update pass runs the closure again instead of a retained graph

    def before(self, p: torch.Tensor) -> None:
        """`p.grad` is complete on this rank (e.g. sum it over the data-parallel ranks)."""

    def after(self, p: torch.Tensor) -> None:
        """`p` was updated (e.g. write it back into this rank's partition)."""

    def after_backward(self) -> None:
        """A backward pass ended."""


class FusedOptimizer(torch.optim.Optimizer):
    """Base class: subclasses implement `_update(p, grad_fp32, group)` for one parameter."""

    def __init__(self, params, defaults: dict, clip_grad_norm: float | None, clip_grad_value: float | None):
        if clip_grad_norm is not None and clip_grad_norm <= 0:
            raise ValueError(f"clip_grad_norm must be positive or None, got {clip_grad_norm}")
        if clip_grad_value is not None and clip_grad_value <= 0:
            raise ValueError(f"clip_grad_value must be positive or None, got {clip_grad_value}")
        super().__init__(params, defaults)
        self.clip_grad_norm = clip_grad_norm
        self.clip_grad_value = clip_grad_value
        self.last_grad_norm = math.nan
        self.engine_hooks = EngineHooks()
        self._mode: str | None = None  # None outside fused_step: a stray backward leaves grads alone
        self._sq_norm: torch.Tensor | None = None  # running sum of squared gradient norms, one 0-d tensor
        self._clip_coef: torch.Tensor | None = None
        self._done: set[int] = set()
        self._group_of: dict[int, dict] = {}
        # A weak reference: the hooks live on the parameters and must not keep the optimizer alive.
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            opt = ref()
            if opt is not None:
                opt._on_grad(p)

        self._handles = [p.register_post_accumulate_grad_hook(hook)
                         for g in self.param_groups for p in g["params"] if p.requires_grad]

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # --- the hook -------------------------------------------------------------------------------
    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        if self._mode is None or p.grad is None:  # None: measured without being built (add_sq_norm)
            return
        if id(p) in self._done:
            # Autograd finished this parameter's gradient twice in one pass (reentrant activation
            # checkpointing around a shared weight): updating on a partial gradient would be wrong.
            raise RuntimeError("a parameter's gradient was completed twice in one backward pass; with "
                               "LOMO/AdaLomo use non-reentrant gradient checkpointing")
        self._done.add(id(p))
        self.engine_hooks.before(p)
        grad = p.grad.to(torch.float32)  # no copy when the weights are fp32
        p.grad = None
        self._add_norm(grad)
        if self._mode == "norm":
            return
        self._apply(p, grad)
        self.engine_hooks.after(p)

    def _add_norm(self, grad: torch.Tensor) -> None:
        # Summed into one tensor (no host sync on GPU); a list of per-parameter 0-d tensors would scatter
        # small long-lived blocks across the heap and keep freed gradient memory resident.
        norm = torch.linalg.vector_norm(grad)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if self._sq_norm is None:
            self._sq_norm = norm.square()
        else:
            self._sq_norm.addcmul_(norm, norm)

    @property
    def measuring(self) -> bool:
        """In the norm pass of a clipped step: gradients are only measured, not used (see tied.py)."""
        return self._mode == "norm"

    def add_sq_norm(self, sq: torch.Tensor) -> None:
        """Count a gradient measured without being built (a squared norm, a fresh 0-d tensor)."""
        self._sq_norm = sq if self._sq_norm is None else self._sq_norm.add_(sq)

    def _apply(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Clip one fp32 gradient (value, then the global-norm coefficient) and update its parameter."""
        if self.clip_grad_value is not None:
            grad.clamp_(-self.clip_grad_value, self.clip_grad_value)
        if self._clip_coef is not None:
            # A DTensor gradient takes a Python number: a plain 0-d tensor would not mix with it.
            grad.mul_(float(self._clip_coef) if isinstance(grad, DTensor) else self._clip_coef)
        self._update(p, grad, self._group_of[id(p)])

    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        raise NotImplementedError

    # --- one training step ----------------------------------------------------------------------
    def _backward(self, loss: torch.Tensor, mode: str, retain_graph: bool) -> torch.Tensor:
        self._mode, self._sq_norm, self._done = mode, None, set()
        try:
            loss.backward(retain_graph=retain_graph)
        finally:
            self._mode = None
            self.engine_hooks.after_backward()
        if self._sq_norm is None:
            return torch.tensor(math.nan)
        return self._sq_norm.sqrt()

    def _set_clip(self, total: torch.Tensor) -> None:
        self._clip_coef = None
        if self.clip_grad_norm is not None:
            self._clip_coef = torch.clamp(self.clip_grad_norm / (total + 1e-6), max=1.0)

    def step(self, closure: Closure | None = None, *,  # type: ignore[override]  # grad_norm: ours
             grad_norm: float | torch.Tensor | None = None):
        """With a closure: forward (the closure), then backward pass(es) that update every parameter on
        the way. Without one: the update from gradients already accumulated by the caller's backward,
        clipped with `grad_norm` (the global norm; computed over this optimizer's gradients if None)."""
        # Rebuilt every step: load_state_dict replaces the group dicts.
        self._group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        if closure is None:
            return self._step_accumulated(grad_norm)
        self.zero_grad(set_to_none=True)  # stale gradients would leak into the first hook
        with torch.enable_grad():
            loss = closure()
        self._clip_coef = None
        if self.clip_grad_norm is not None:
            reforward = self.engine_hooks.reforward
            total = self._backward(loss, "norm", retain_graph=not reforward)
            self._set_clip(total)
            if reforward:  # the same weights and batch: the same loss and gradients
                with torch.enable_grad():
                    loss = closure()
            self._backward(loss, "update", retain_graph=False)
        else:
            total = self._backward(loss, "update", retain_graph=False)
        self.last_grad_norm = float(total)  # the norm before clipping, as clip_grad_norm_ reports it
        return loss

    @torch.no_grad()
    def _step_accumulated(self, grad_norm) -> None:
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if grad_norm is None:
            self._sq_norm = None
            for p in params:
                self._add_norm(p.grad.to(torch.float32))
            grad_norm = self._sq_norm.sqrt() if self._sq_norm is not None else torch.tensor(math.nan)
        total = torch.as_tensor(grad_norm, dtype=torch.float32)
        self._set_clip(total)
        for p in params:
            grad = p.grad.to(torch.float32)
            p.grad = None  # freed as soon as its parameter is updated, as in backward
            self._apply(p, grad)
        self.last_grad_norm = float(total)

    def fused_step(self, closure: Closure) -> tuple[float, float]:
        """The training loop's entry point: (loss, global gradient norm before clipping)."""
        loss = self.step(closure)  # through step(), so LR schedulers see that the optimizer stepped
        return float(loss.detach()), self.last_grad_norm
