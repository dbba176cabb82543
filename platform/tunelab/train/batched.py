"""Batched mode of a together-group (#46, opt-in: `exp run --together-mode batched`): the members' rows of one step
in one pass through the shared base, each row through its own member's adapter, then each member's own clipping,
optimizer and schedule (train/loop.py `advance` with the backward already done).

How a pass is made of the members' batches (`join`): each member's micro-batch as the loop drew it, its rows one
after another's, right-padded to the widest (pad ids, attention mask 0, label -100: under causal attention a real
token never sees a later position, so the padding changes no real token's numbers but for float rounding).

How a row meets its own adapter (`routing`): while the pass runs, every peft tuner layer's forward is replaced by
one that runs the base layer once over all rows and adds each member's part on its rows only, computed by peft's
own modules of that member (LoRA's A, B, dropout and scaling; DoRA's variant forward; IA3's vector), on the member's
rows and its own width, so a member's dropout draws the same numbers, in the same order and shapes, as alone: its
own random stream (`Route.stream`) is put in place for each draw. peft's `adapter_names=` batches are for inference
and refuse DoRA; this routes in plain torch for training. Evaluation's router (evals/engine/route.py) is its
inference counterpart: it writes in place under no_grad and routes token ranges of packed passes; this one is
differentiable (no in-place writes), routes whole rows, and draws each member's dropout from its own stream.

The loss: the decoder body once over the joined batch, then each member's output head and loss on its rows
(train/loss.py's head at labelled positions, its head settings in place), divided by its own label tokens; the
members' losses summed and backpropagated once. A member's adapter touches only its rows, so its gradients are
those of its own loss. So one step from the same state gives each member the loss and gradients it has alone up
to float rounding (tested within 1e-6, fp32); whole trajectories are not promised (a sign-based optimizer such as
Lion turns a rounding difference into a step of full size).

What cannot be batched runs exact (run/together.py `why_not_batched`): packed rows, gradient checkpointing with
LoRA dropout (the recomputation would draw again), a base that draws random numbers itself (dropout in the
model), prompt learning, tuner layers other than linear ones.
"""

from __future__ import annotations

import contextlib
import time
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tunelab.train.loss import IGNORE, _causal_lm, head_loss, shifted_labels
from tunelab.train.parallel.local import autocast


@dataclass
class Route:
    """One member's place in a joined batch: its adapter's name, its rows, its own width, and its random stream
    (the torch generator's state of the pass's device, advanced by its dropout as alone)."""

    name: str
    rows: slice
    width: int
    rng: torch.Tensor | None = None

    @contextlib.contextmanager
    def stream(self, device: torch.device) -> Iterator[None]:
        gen = torch.default_generator if device.type == "cpu" else torch.cuda.default_generators[device.index or 0]
        outer = gen.get_state()
        if self.rng is not None:
            gen.set_state(self.rng)
        try:
            yield
        finally:
            self.rng = gen.get_state()
            gen.set_state(outer)


def join(batches: Sequence[dict], pad_id: int) -> tuple[dict, list[tuple[slice, int]]]:
    """The members' micro-batches as one, right-padded to the widest -> (batch, each member's (rows, width))."""
    width = max(b["input_ids"].shape[1] for b in batches)
    fill = {"input_ids": pad_id, "labels": IGNORE, "attention_mask": 0}
    out: dict[str, list[torch.Tensor]] = {k: [] for k in batches[0]}
    spans, at = [], 0
    for b in batches:
        n, w = b["input_ids"].shape
        for k, v in b.items():
            out[k].append(torch.nn.functional.pad(v, (0, width - w), value=fill[k]) if w < width else v)
        spans.append((slice(at, at + n), w))
        at += n
    return {k: torch.cat(v) for k, v in out.items()}, spans


def _ia3_forward(layer: Any, routes: list[Route], x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """peft's IA3 Linear forward with each member's vector on its rows (other rows: the base alone)."""
    previous = x.dtype
    vecs = {r.name: layer.ia3_l[r.name].flatten() for r in routes}
    dtype = next(iter(vecs.values())).dtype
    n = next(iter(vecs.values())).numel()
    ones = torch.ones(1, 1, n, dtype=dtype, device=x.device)
    parts, at = [], 0
    for r in routes:  # one scaling row per batch row: [rows, 1, n]
        if r.rows.start > at:
            parts.append(ones.expand(r.rows.start - at, 1, n))
        parts.append(vecs[r.name].view(1, 1, n).expand(r.rows.stop - r.rows.start, 1, n))
        at = r.rows.stop
    if at < x.shape[0]:
        parts.append(ones.expand(x.shape[0] - at, 1, n))
    scaling = torch.cat(parts)
    if layer.is_feedforward:
        return layer.base_layer((x.to(dtype) * scaling).to(previous), *args, **kwargs)
    result = layer.base_layer(x, *args, **kwargs)
    return (result * scaling).to(result.dtype)


def _lora_forward(layer: Any, routes: list[Route], x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """peft's LoRA Linear forward (DoRA through its variant) with each member's part on its rows and width."""
    result = layer.base_layer(x, *args, **kwargs)
    dtype = result.dtype
    parts, at = [], 0
    for r in routes:
        if r.rows.start > at:
            parts.append(result[at:r.rows.start])
        mine = result[r.rows]
        own, xm = mine[:, :r.width], x[r.rows, :r.width]
        a, b, drop = layer.lora_A[r.name], layer.lora_B[r.name], layer.lora_dropout[r.name]
        xm = layer._cast_input_dtype(xm, a.weight.dtype)
        draws = layer.training and not isinstance(drop, torch.nn.Identity)
        with r.stream(x.device) if draws else contextlib.nullcontext():
            if r.name in layer.lora_variant:
                own = layer.lora_variant[r.name].forward(layer, active_adapter=r.name, x=xm, result=own)
            else:
                own = own + b(a(drop(xm))) * layer.scaling[r.name]
        parts.append(torch.cat([own, mine[:, r.width:]], 1) if r.width < mine.shape[1] else own)
        at = r.rows.stop
    if at < result.shape[0]:
        parts.append(result[at:])
    return torch.cat(parts).to(dtype)


def _routed(layer: Any, routes: list[Route]) -> Any:
    from peft.tuners.ia3.layer import IA3Layer

    from tunelab.train.members import hosts

    mine = [r for r in routes if hosts(layer, r.name)]
    fn = _ia3_forward if isinstance(layer, IA3Layer) else _lora_forward
    return types.MethodType(lambda self, x, *a, **k: fn(self, mine, x, *a, **k) if mine else
                            self.base_layer(x, *a, **k), layer)


@contextlib.contextmanager
def routing(model: Any, routes: list[Route]) -> Iterator[None]:
    """Every tuner layer of `model` routes rows to their members' adapters while the context is open."""
    from tunelab.train.members import tuner_layers

    layers = tuner_layers(model)
    for layer in layers:
        layer.forward = _routed(layer, routes)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # the class's forward again


def unroutable(model: Any) -> str | None:
    """Why this model's tuner layers or base cannot take a batched pass, in words; None: they can."""
    from peft.tuners.ia3.layer import Linear as IA3Linear
    from peft.tuners.lora.layer import Linear as LoraLinear

    from tunelab.train.members import tuner_layers

    if _causal_lm(model) is None:
        return "the model does not take the head-at-labels path (train/loss.py)"
    layers = tuner_layers(model)
    other = {type(layer).__name__ for layer in layers if not isinstance(layer, (LoraLinear, IA3Linear))}
    if other:
        return f"tuner layers other than linear ones ({', '.join(sorted(other))})"
    adapters = {id(m) for layer in layers for m in layer.modules()}
    draws = [n for n, m in model.named_modules()
             if isinstance(m, torch.nn.Dropout) and m.p > 0 and id(m) not in adapters]
    if draws or any(getattr(model.config, k, 0) for k in ("attention_dropout", "hidden_dropout", "dropout")):
        return "the base model draws random numbers itself (dropout): each member's would come from one stream"
    return None


@dataclass
class Pass:
    """One batched step of several members: each one's summed loss, and each one's share of the pass's time."""

    losses: list[torch.Tensor]
    seconds: float


def backward(members: Sequence[Any], micro: Sequence[list[dict]], n_items: Sequence[int], pad_id: int,
             device: torch.device, precision: str) -> Pass:
    """The backward passes of one step of `members` (train.members.Member, their random states in `m.rng`), their
    micro-batches `micro[j]` and label tokens `n_items[j]`: one forward and one backward per micro-batch index
    through the shared base. Each member's gradients are left on its parameters and its random state advanced as
    alone; the caller finishes each member's step (clipping, optimizer) in its turn."""
    from tunelab.train.members import activate_all
    from tunelab.train.modes import set_training

    t0 = time.perf_counter()
    model = members[0].model
    lm = _causal_lm(model)
    body, head = getattr(lm, lm.base_model_prefix), lm.get_output_embeddings()
    cuda = device.type == "cuda"
    routes = [Route(m.name, slice(0, 0), 0, (m.rng["cuda"][device.index or 0] if cuda else m.rng["torch"]))
              for m in members]
    losses = [torch.zeros((), device=device) for _ in members]
    activate_all(model, [m.name for m in members])
    set_training(model, True)
    with routing(model, routes):  # the routes' rows and widths are set for each micro-batch below
        for i in range(len(micro[0])):
            batch, spans = join([mb[i] for mb in micro], pad_id)
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            for r, (rows, width) in zip(routes, spans):
                r.rows, r.width = rows, width
            with autocast(precision, device):
                hidden = body(**{k: v for k, v in batch.items() if k != "labels"}).last_hidden_state
                total = None
                for j, (m, (rows, width)) in enumerate(zip(members, spans)):
                    if m.head is not None:
                        m.head.put()
                    shift = shifted_labels(batch["labels"][rows, :width]).flatten()
                    keep = (shift != IGNORE).nonzero().squeeze(1)
                    loss = head_loss(head, hidden[rows, :width].flatten(0, 1)[keep], shift[keep]) / n_items[j]
                    losses[j] += loss.detach()
                    total = loss if total is None else total + loss
            assert total is not None
            total.backward()
    for m, r in zip(members, routes):  # each member's stream, advanced by its own draws
        if cuda:
            m.rng["cuda"][device.index or 0] = r.rng
        else:
            m.rng["torch"] = r.rng
    return Pass(losses, (time.perf_counter() - t0) / len(members))
