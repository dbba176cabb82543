"""Several PEFT adapters of one frozen base in one forward pass: each row through its own adapter, the base unmerged.

peft's own mixed-adapter batches (`adapter_names=`) refuse DoRA, have nothing for IA3 and route whole batch rows;
the engine's passes are one packed sequence whose token ranges (segments) belong to different requests. So while
`installed(model)` holds, every LoRA, DoRA and IA3 `Linear` of the model gets a forward of its own that, when a
route is set, runs the base (and any tuner layer nested inside it) once for every row and each adapter only on its
own rows, with peft's expression for that adapter; with no route set it is peft's forward, untouched.

A route is a list of blocks (adapter name or None, first row, end row) over the flattened leading dimensions of a
layer's input (batch x tokens); rows outside every block, and blocks of None, go through the base alone.
`only(name)` routes every row, whatever the shape, to one adapter (HFLM's own padded batches, validation loss,
`model.generate`).

Rounding: a row's numbers must not depend on the rows beside it (packed.py's ROW_QUANTUM): on CPU, MKL's sgemm
rounds a row differently when a thread gets fewer than 4 rows. In a pass, an adapter's block is padded to a
multiple of the pass's quantum (packed.ROW_QUANTUM) for its matrix products (its last row repeated, the copies
dropped), so its rows round as they do when the adapter is alone in the pass: together and alone then agree bit
for bit on CPU (tests/test_eval_together.py). Evaluation only: routing runs without autograd.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch

_ROUTER_ATTR = "_tunelab_router"
_ORIGINAL_ATTR = "_tunelab_forward"
ALL = -1  # a block's end: every row of the layer's input


class Router:
    """The route of the pass being run (None: peft's own forwards) for the model it is installed on."""

    def __init__(self) -> None:
        self.blocks: list[tuple[str | None, int, int]] | None = None
        self.rows = 0  # rows of the pass the blocks index (ALL blocks: any)
        self.quantum = 1  # an adapter's rows are padded to a multiple of this for its matrix products
        self.layers: list[torch.nn.Module] = []

    @contextlib.contextmanager
    def route(self, blocks: list[tuple[str | None, int, int]] | None, rows: int = 0,
              quantum: int = 1) -> Iterator[None]:
        """The pass's `rows` by adapter while the block runs; None leaves the model as it is."""
        saved = self.blocks, self.rows, self.quantum
        self.blocks, self.rows, self.quantum = blocks, rows, quantum
        try:
            yield
        finally:
            self.blocks, self.rows, self.quantum = saved

    def only(self, name: str | None) -> contextlib.AbstractContextManager[None]:
        """Every row through adapter `name` (None: the model as it is)."""
        return self.route(None if name is None else [(name, 0, ALL)])


def router_of(model) -> Router | None:
    return getattr(model, _ROUTER_ATTR, None)


def unroutable(model, adapters: list[str]) -> str | None:
    """Why `adapters` cannot share passes on `model` (a tuner layer routing does not cover hosts one of them, or
    one is missing), or None."""
    from peft.tuners.ia3.layer import Linear as IA3Linear
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found: set[str] = set()
    for name, layer in model.named_modules():
        if not isinstance(layer, BaseTunerLayer):
            continue
        hosted = {a for attr in layer.adapter_layer_names for a in getattr(layer, attr)} & set(adapters)
        found |= hosted
        if hosted and (layer is head or type(layer) not in (LoraLinear, IA3Linear)):
            what = "the output head" if layer is head else f"a {type(layer).__module__}.{type(layer).__name__}"
            return (f"adapter {sorted(hosted)[0]!r} adapts {name} ({what}); evaluation routes the adapters of "
                    "LoRA, DoRA and IA3 Linear layers of the body only")
    missing = [a for a in adapters if a not in found]
    return f"no tuner layer of the model hosts adapter {missing[0]!r}" if missing else None


@contextlib.contextmanager
def installed(model) -> Iterator[Router]:
    """Routed forwards on every LoRA/DoRA/IA3 Linear of `model` while the block runs (peft's back after); nested
    installs share the first one's router."""
    from peft.tuners.ia3.layer import Linear as IA3Linear
    from peft.tuners.lora.layer import Linear as LoraLinear

    existing = router_of(model)
    if existing is not None:
        yield existing
        return
    router, own = Router(), []  # own: whether a layer's forward was an instance attribute (a hook's) before
    for layer in model.modules():
        fn = _lora if type(layer) is LoraLinear else _ia3 if type(layer) is IA3Linear else None
        if fn is None:
            continue
        own.append("forward" in layer.__dict__)
        setattr(layer, _ORIGINAL_ATTR, layer.forward)
        layer.forward = types.MethodType(_routed(fn, router), layer)
        router.layers.append(layer)
    setattr(model, _ROUTER_ATTR, router)
    try:
        yield router
    finally:
        delattr(model, _ROUTER_ATTR)
        for layer, instance in zip(router.layers, own):
            if instance:
                layer.forward = getattr(layer, _ORIGINAL_ATTR)
            else:
                del layer.forward  # the class's forward again
            delattr(layer, _ORIGINAL_ATTR)


def _routed(fn, router: Router):
    def forward(layer, x, *args, **kwargs):
        blocks = router.blocks
        if blocks is None:
            return getattr(layer, _ORIGINAL_ATTR)(x, *args, **kwargs)
        if torch.is_grad_enabled():
            raise RuntimeError("adapter routing is for evaluation: run it under torch.no_grad or inference_mode")
        rows = x.numel() // x.shape[-1]
        if blocks[0][2] == ALL:
            blocks = [(blocks[0][0], 0, rows)]
        elif rows != router.rows:
            raise RuntimeError(f"a routed layer saw {rows} rows in a pass of {router.rows}")
        return fn(layer, x, blocks, router.quantum, args, kwargs)

    return forward


def _padded_rows(t: torch.Tensor, a: int, b: int, quantum: int) -> torch.Tensor:
    """Rows [a, b) of the flat `t`, padded with copies of the last to a multiple of `quantum` (unless they are every
    row: then as the model alone computes them)."""
    part = t[a:b]
    pad = -(b - a) % quantum
    if pad == 0 or (a == 0 and b == t.shape[0]):
        return part
    return torch.cat([part, part[-1:].expand(pad, -1)])


def _lora(layer, x, blocks, quantum, args, kwargs) -> torch.Tensor:
    """peft's lora.Linear.forward (LoRA, and DoRA through peft's own variant) on each adapter's rows."""
    result = layer.base_layer(x, *args, **kwargs)
    hosted = [(n, a, b) for n, a, b in blocks if n is not None and n in layer.lora_A and b > a]
    if not hosted:
        return result
    dtype = result.dtype
    flat_x, out = x.reshape(-1, x.shape[-1]), result.view(-1, result.shape[-1])  # out: written in place
    for name, a, b in hosted:
        xs = layer._cast_input_dtype(_padded_rows(flat_x, a, b, quantum), layer.lora_A[name].weight.dtype)
        if name not in layer.lora_variant:  # LoRA: result + lora_B(lora_A(dropout(x))) * scaling
            delta = layer.lora_B[name](layer.lora_A[name](layer.lora_dropout[name](xs))) * layer.scaling[name]
            out[a:b] = (out[a:b] + delta[: b - a]).to(dtype)
        else:  # DoRA: the variant's own forward on these rows
            rs = _padded_rows(out, a, b, quantum)
            out[a:b] = layer.lora_variant[name].forward(layer, active_adapter=name, x=xs, result=rs)[: b - a]
    return result


def _ia3(layer, x, blocks, quantum, args, kwargs) -> torch.Tensor:
    """peft's ia3.Linear.forward on each adapter's rows: a feed-forward layer scales its input (then the base runs
    once), the others scale the base's output."""
    hosted = [(n, a, b) for n, a, b in blocks if n is not None and n in layer.ia3_l and b > a]
    if not hosted:
        return layer.base_layer(x, *args, **kwargs)
    if layer.is_feedforward:
        scaled = x.reshape(-1, x.shape[-1]).clone()
        for name, a, b in hosted:
            scale = layer.ia3_l[name]
            scaled[a:b] = (scaled[a:b].to(scale.dtype) * scale.flatten()).to(x.dtype)
        return layer.base_layer(scaled.view_as(x), *args, **kwargs)
    result = layer.base_layer(x, *args, **kwargs)
    out = result.view(-1, result.shape[-1])  # written in place
    for name, a, b in hosted:
        out[a:b] = (out[a:b] * layer.ia3_l[name].flatten()).to(result.dtype)
    return result
