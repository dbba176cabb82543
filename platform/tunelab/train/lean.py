"""RMSNorm and the SiLU-gated MLP keeping less for backward: the same forward, fewer activations.

What transformers' Llama-family modules keep for backward, per token and layer, beyond their inputs:
- RMSNorm (`weight * (x * rsqrt(mean(x^2) + eps))`) keeps the normalized `x * rsqrt(...)` for the weight's
  product: h values a norm, two norms a layer (and, for a half-precision `x`, an fp32 copy of it as well);
- the MLP (`down(silu(gate(x)) * up(x))`) keeps the SiLU's output for the product: i values a layer.
Here each is one autograd Function that keeps its inputs (and the norm's one scale a row) and recomputes the
rest in backward, as Liger's fused RMSNorm and SwiGLU kernels do: 2h + i fewer values a token and layer
(SmolLM2-135M: 2,688 of 12,288 in fp32, 22% of the decoder body's activations), for a few elementwise
passes in backward. Forward runs the modules' own operations in their order, so its outputs are bit for bit
the modules'; the SiLU-product's backward runs autograd's own operations (bit for bit too), the norm's is
its closed form, equal to autograd's up to float rounding (tests/test_train_lean.py: within 1e-6 in fp32).

`apply(model)` swaps the class of every module whose class's forward is transformers' LlamaRMSNorm or LlamaMLP code
for a subclass with the lean forward (`_lean_class`: an instance-level forward would not survive transformers'
kernelize at every mode switch) (Mistral, Qwen2/3, OLMo-2's MLP, Phi-3's norm share it; the source is compared, not
the name), the MLP only with a SiLU activation. Every layout gets it (train/parallel/steppers.prepare): the modules
are still called, so FSDP2's, DeepSpeed's and the tensor-parallel plan's hooks run around them as before.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MARK = "tunelab_lean"  # set on a module whose forward was swapped


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.to(torch.float32)
        scale = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, scale)
        return weight * (xf * scale).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        x, weight, scale = ctx.saved_tensors
        normed = x.to(torch.float32) * scale
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad * normed.to(x.dtype)).sum_to_size(weight.shape)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = (grad * weight).to(torch.float32)
            # d/dx of x * (mean(x^2) + eps)^-1/2, with n = x * scale: scale * (g - n * mean(g * n))
            grad_x = (g - normed * (g * normed).mean(-1, keepdim=True)).mul_(scale).to(x.dtype)
        return grad_x, grad_w, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNorm.apply(x, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _SiluMul.apply(gate, up)


BASE_FORWARD = "_tunelab_base_forward"  # on a lean class: the forward of the class it swaps for


def _norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    if not (torch.is_grad_enabled() and (hidden_states.requires_grad or self.weight.requires_grad)):
        return getattr(type(self), BASE_FORWARD)(self, hidden_states)  # nothing kept for backward: the module's code
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():  # evaluation and decoding: the module's own code, no Function call
        return getattr(type(self), BASE_FORWARD)(self, x)
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


@functools.cache
def _lean_class(cls: Any, kind: str) -> type:
    """`cls` with the lean forward as its class's own. Not an instance's forward: transformers' kernelize (run by
    every model.train() / eval() of a model that uses hub kernels, the default where `kernels` is installed) gives
    each kernel layer (RMSNorm is one) the forward of its class again, and drops an instance-level one; the lean
    norm then silently went at the first mode switch. Where a hub kernel is mapped for the device (Liger's RMSNorm
    on CUDA), kernelize still puts it in, over this class's forward."""
    forward = _norm_forward if kind == "norm" else _mlp_forward
    body = {"forward": forward, BASE_FORWARD: cls.forward, "__module__": cls.__module__,
            "__qualname__": f"Lean{cls.__qualname__}"}
    return type(f"Lean{cls.__name__}", (cls,), body)


@functools.cache
def _reference_sources() -> tuple[str, str]:
    from transformers.models.llama import modeling_llama

    return inspect.getsource(modeling_llama.LlamaRMSNorm.forward), inspect.getsource(modeling_llama.LlamaMLP.forward)


@functools.cache
def _kind(cls: Any) -> str | None:
    """"norm" or "mlp" when `cls.forward` is transformers' Llama code for it, else None."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None
    norm, mlp = _reference_sources()
    return "norm" if source == norm else "mlp" if source == mlp else None


def _silu(act: Any) -> bool:
    from transformers.activations import SiLUActivation

    return isinstance(act, (nn.SiLU, SiLUActivation))


def apply(model: nn.Module) -> int:
    """Swap the forward of every matching norm and MLP module under `model`; the number swapped."""
    swapped = 0
    for module in model.modules():
        if getattr(module, MARK, False) or "forward" in module.__dict__:
            continue  # done already, or another instance-level forward is in charge
        kind = _kind(type(module))  # type: ignore[arg-type]  # classes hash by identity
        if kind == "mlp" and not _silu(getattr(module, "act_fn", None)):
            kind = None
        if kind is None:
            continue
        module.__class__ = _lean_class(type(module), kind)  # type: ignore[arg-type]  # classes hash by identity
        setattr(module, MARK, True)
        swapped += 1
    return swapped
