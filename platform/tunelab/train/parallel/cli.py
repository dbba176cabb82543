"""`exp memory`: predicted per-device memory of a training layout, and the devices it needs."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from tunelab.errors import UserError
from tunelab.registries import OPTIMIZERS
from tunelab.train.parallel.memory import DTYPE_BYTES, GB, SHAPES, Setup, devices_needed, estimate

out = Console()


def memory(
    model: Annotated[str, typer.Option(help=f"catalog alias, local folder, hub id, or one of {', '.join(SHAPES)}")],
    optim: Annotated[str, typer.Option(help=f"one of {', '.join(OPTIMIZERS)}")] = "adamw",
    peft: Annotated[str, typer.Option(help="none or lora")] = "none",
    lora_r: Annotated[int, typer.Option(help="LoRA rank")] = 8,
    dp: Annotated[int, typer.Option(help="data-parallel degree")] = 1,
    tp: Annotated[int, typer.Option(help="tensor-parallel degree")] = 1,
    pp: Annotated[int, typer.Option(help="pipeline-parallel degree")] = 1,
    zero: Annotated[int, typer.Option(help="what dp shards: 1 optimizer, 2 + gradients, 3 + parameters")] = 3,
    backend: Annotated[str, typer.Option(help="native (FSDP2, TP, pipelines) or deepspeed (ZeRO)")] = "native",
    microbatches: Annotated[int, typer.Option(help="pipeline chunks per batch")] = 1,
    pp_schedule: Annotated[str, typer.Option(help="gpipe, 1f1b or interleaved_1f1b")] = "1f1b",
    seq: Annotated[int, typer.Option(help="tokens per row")] = 2048,
    batch: Annotated[int, typer.Option(help="rows per step (global micro-batch)")] = 1,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16")] = "bfloat16",
    activation_checkpointing: Annotated[bool, typer.Option(help="recompute each layer in backward")] = False,
    device_gb: Annotated[float, typer.Option(help="memory of one device, GB")] = 80.0,
) -> None:
    """Predict per-device memory (parameters, gradients, optimizer state, activations) from the model's config."""
    from tunelab.train.parallel.memory import load_shape

    checks = {"--optim": (optim, OPTIMIZERS), "--peft": (peft, ("none", "lora")), "--dtype": (dtype, DTYPE_BYTES),
              "--pp-schedule": (pp_schedule, ("gpipe", "1f1b", "interleaved_1f1b")), "--zero": (zero, (1, 2, 3)),
              "--backend": (backend, ("native", "deepspeed"))}
    for flag, (value, allowed) in checks.items():
        if value not in allowed:
            raise UserError(f"{flag} {value!r} is not one of {', '.join(map(str, allowed))}")
    if min(dp, tp, pp, microbatches, seq, batch, lora_r) < 1 or device_gb <= 0:
        raise UserError("--dp, --tp, --pp, --microbatches, --seq, --batch, --lora-r and --device-gb must be positive")
    try:
        shape = load_shape(model)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the config of {model!r}: {e}", key="--model") from None
    s = Setup(optim=optim, peft=peft, lora_r=lora_r, dtype=dtype, dp=dp, tp=tp, pp=pp, zero=zero, seq=seq,
              batch=batch, microbatches=microbatches, pp_schedule=pp_schedule,
              activation_checkpointing=activation_checkpointing, backend=backend)
    e = estimate(shape, s)
    table = Table(title=f"{model}: {e.total_params / 1e9:.3f} B parameters ({e.trainable / 1e9:.4f} B trainable), "
                        f"{optim}, peft {peft}, dp {dp} x tp {tp} x pp {pp}, zero {zero}, {backend}, {dtype}")
    table.add_column("per device")
    table.add_column("GB", justify="right")
    built = "sharded" if s.sharded_init else "whole"
    for name, label in (("params", "params"), ("grads", "grads"), ("optimizer", "optimizer"),
                        ("activations", "activations"), ("buffers", "engine buffers"), ("train", "training step"),
                        ("load", f"load (built {built})"), ("peak", "peak")):
        table.add_row(label, f"{getattr(e, name) / GB:.2f}")
    out.print(table)
    fits = "fits" if e.peak <= device_gb * GB else "does NOT fit"
    out.print(f"this layout ({dp * tp * pp} devices) {fits} on {device_gb:g} GB devices")
    need = devices_needed(shape, s, device_gb)
    out.print(f"devices needed (growing dp, tp {tp} x pp {pp}, zero {zero}): "
              + (str(need) if need else "none fits: use zero 3, more tp/pp, or activation checkpointing"))
