"""`exp ls`, `exp models`, `exp memory`: what a matrix can name, and what a layout will need."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tunelab.cli.common import INSPECT, Json, app, err, out, print_json, print_wide
from tunelab.core.errors import UserError
from tunelab.core.registries import ENGINES, OPTIMIZERS
from tunelab.train.parallel.memory import (
    DTYPE_BYTES,
    GB,
    SHAPES,
    Estimate,
    Setup,
    devices_needed,
    estimate,
    steps_exact,
)


def _kinds_help() -> str:
    from tunelab.tools.listing import KINDS

    return f"{', '.join(KINDS[:-1])} or {KINDS[-1]}; all of them when left out"


MOST_MEMBERS = 4096  # `exp memory --together N`: an estimate is built per member
LINES_FROM = 200  # rows from which a kind is listed as plain lines: a box drawn around thousands of rows helps no one


@app.command("ls", rich_help_panel=INSPECT)
def ls(kind: Annotated[str | None, typer.Argument(help=_kinds_help(), show_default=False)] = None,
       as_json: Json = False,
       everything: Annotated[bool, typer.Option("--all", help="tasks: also every task and group of lm-eval, with "
                                                "its output type (indexed once per lm-eval version, ~15 s)")] = False,
       include_path: Annotated[str | None, typer.Option("--include-path", help="tasks: also the tasks and groups of "
                                                        "this folder of lm-eval task YAMLs")] = None,
       pattern: Annotated[str | None, typer.Option("--filter", help="only the names (or descriptions) that contain "
                                                   "this text, or match it as a glob (arc_*)")] = None) -> None:
    """List what a matrix can name, one line each: registered names and the content folders' files."""
    from tunelab.tools.listing import KINDS, rows

    if kind is not None and kind not in KINDS:
        raise UserError(f"exp ls {kind!r}: allowed are {', '.join(KINDS)}")
    if include_path is not None and not Path(include_path).expanduser().is_dir():
        raise UserError(f"no such folder: {Path(include_path).expanduser().absolute()} (a folder of lm-eval task "
                        f"YAMLs; a relative path is relative to the folder exp runs in, {Path.cwd()})",
                        key="--include-path")
    kinds = [kind] if kind else list(KINDS)
    if everything and "tasks" in kinds:
        from tunelab.plan import lmtasks

        if not lmtasks.index_file().is_file():
            err.print(f"indexing lm-eval's ~15k task YAMLs once for lm-eval {lmtasks.lm_eval_version()} (10-20 s; "
                      f"kept in {lmtasks.index_file()})", highlight=False, soft_wrap=True)
    found = {k: rows(k, everything, include_path, pattern) for k in kinds}
    if as_json:
        return print_json({k: dict(v) for k, v in found.items()})
    for k, listed in found.items():
        if len(listed) >= LINES_FROM:
            width = max(len(n) for n, _ in listed)
            out.print(f"{k} ({len(listed)}; --filter TEXT narrows them)", highlight=False)
            for name, what in listed:
                out.print(f"  {name:{width}s}  {what}", highlight=False, markup=False, soft_wrap=True)
            continue
        table = Table(title=k, title_justify="left")
        table.add_column("name")
        table.add_column("what")
        for name, what in listed:
            table.add_row(name, what)
        if not listed:
            table.caption = f"none matches {pattern!r}" if pattern else "none"
        print_wide(table)


@app.command(rich_help_panel=INSPECT)
def models(as_json: Json = False) -> None:
    """List the model catalog's aliases (the same as `exp ls models`)."""
    ls("models", as_json)


@app.command("memory", rich_help_panel=INSPECT)
def memory(
    model: Annotated[str, typer.Option(help=f"catalog alias, local folder, hub id, or one of {', '.join(SHAPES)}")],
    optim: Annotated[str, typer.Option(help=f"one of {', '.join(OPTIMIZERS)}")] = "adamw",
    peft: Annotated[str, typer.Option(help="none or lora")] = "none",
    lora_r: Annotated[int, typer.Option(help="LoRA rank")] = 8,
    lora_dropout: Annotated[float, typer.Option(help="LoRA dropout (each adapted layer then keeps a copy of its "
                                                     "input and a mask)")] = 0.05,
    dp: Annotated[int, typer.Option(help="data-parallel degree")] = 1,
    tp: Annotated[int, typer.Option(help="tensor-parallel degree")] = 1,
    pp: Annotated[int, typer.Option(help="pipeline-parallel degree")] = 1,
    zero: Annotated[int, typer.Option(help="what dp shards: 1 optimizer, 2 + gradients, 3 + parameters")] = 3,
    backend: Annotated[str, typer.Option(help=f"the parallel engine: {', '.join(ENGINES)}")] = ENGINES.names()[0],
    microbatches: Annotated[int, typer.Option(help="pipeline chunks per batch")] = 1,
    pp_schedule: Annotated[str, typer.Option(help="gpipe, 1f1b or interleaved_1f1b")] = "1f1b",
    seq: Annotated[int, typer.Option(help="tokens per row")] = 2048,
    batch: Annotated[int, typer.Option(help="rows per step (global micro-batch)")] = 1,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16")] = "bfloat16",
    activation_checkpointing: Annotated[bool, typer.Option(help="recompute each layer in backward")] = False,
    device_gb: Annotated[float, typer.Option(help="memory of one device, GB")] = 80.0,
    together: Annotated[int, typer.Option(help="members of a together-group with this setup each (one process, one "
                                               "device): the base once, adapters and optimizer state per member")] = 1,
    batched: Annotated[bool, typer.Option(help="--together N in batched mode (`exp run --together-mode batched`): "
                                               "every member's activations in one pass")] = False,
    as_json: Json = False,
) -> None:
    """Predict per-device memory (parameters, gradients, optimizer state, activations) from the model's config."""
    from tunelab.train.parallel.memory import estimate_group, load_shape

    s = Setup(optim=optim, peft=peft, lora_r=lora_r, lora_dropout=lora_dropout, dtype=dtype, dp=dp, tp=tp, pp=pp,
              zero=zero, seq=seq, batch=batch, microbatches=microbatches, pp_schedule=pp_schedule,
              activation_checkpointing=activation_checkpointing, backend=backend)
    _check_setup(s, together, device_gb, batched)
    try:
        shape = load_shape(model)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read the config of {model!r}: {err}", key="--model") from None
    est, need = estimate(shape, s), devices_needed(shape, s, device_gb)
    group = estimate_group(shape, [s] * together, batched) if together > 1 else None
    if as_json:
        return print_json({"model": model, "setup": asdict(s), "estimate_bytes": est.as_dict(),
                           "devices": dp * tp * pp, "device_gb": device_gb, "fits": est.peak <= device_gb * GB,
                           "devices_needed": need, **({"together": together, "batched": batched,
                                                       "group_bytes": group.as_dict(),
                                                       "group_fits": group.peak <= device_gb * GB} if group else {})})
    _print_estimate(model, s, est, need, device_gb)
    if group is not None:
        more = (group.params + group.optimizer - est.params - est.optimizer) / (together - 1)
        steps = "every member's step in one pass" if batched and not steps_exact(s) else \
            "one member's step at a time" + (" (these members step exact in batched mode too: run/together.py "
                                             "why_not_batched)" if batched else "")
        out.print(f"together-group of {together} such members on one device "
                  f"({'batched' if batched else 'exact'} mode): the base's weights once, "
                  f"{more / GB:.3f} GB more per member after the first (its adapter, optimizer state and objects), "
                  f"{steps}: peak {group.peak / GB:.2f} GB "
                  f"({'fits' if group.peak <= device_gb * GB else 'does not fit'} {device_gb:g} GB)", highlight=False)


def _check_setup(s: Setup, together: int, device_gb: float, batched: bool = False) -> None:
    """`exp memory`'s options against what each allows (exit 2, naming the option)."""
    allowed: dict[str, tuple[object, Collection]] = {
        "--optim": (s.optim, OPTIMIZERS), "--peft": (s.peft, ("none", "lora")), "--dtype": (s.dtype, DTYPE_BYTES),
        "--pp-schedule": (s.pp_schedule, ("gpipe", "1f1b", "interleaved_1f1b")), "--zero": (s.zero, (1, 2, 3)),
        "--backend": (s.backend, ENGINES)}
    for flag, (value, choices) in allowed.items():
        if value not in choices:
            raise UserError(f"{flag} {value!r} is not one of {', '.join(map(str, choices))}")
    if not 0 <= s.lora_dropout < 1:
        raise UserError(f"--lora-dropout {s.lora_dropout} is not in [0, 1)")
    if min(s.dp, s.tp, s.pp, s.microbatches, s.seq, s.batch, s.lora_r, together) < 1 or not device_gb > 0 \
            or not math.isfinite(device_gb):
        raise UserError("--dp, --tp, --pp, --microbatches, --seq, --batch, --lora-r, --together and --device-gb must "
                        "be positive")
    if together > 1 and (s.peft == "none" or s.dp * s.tp * s.pp > 1 or ENGINES[s.backend].steps_alone):
        raise UserError("--together N: members of a together-group share a frozen base on one plain process: give "
                        "--peft lora and no --dp, --tp, --pp or an engine that steps alone (--backend)")
    if together > MOST_MEMBERS:
        raise UserError(f"--together {together}: at most {MOST_MEMBERS:,} members (a group on one device)")
    if batched and together == 1:
        raise UserError("--batched: the members of a together-group in batched mode; give --together N (2 or more)")


def _print_estimate(model: str, s: Setup, est: Estimate, need: int | None, device_gb: float) -> None:
    table = Table(title=f"{model}: {est.total_params / 1e9:.3f} B parameters ({est.trainable / 1e9:.4f} B "
                        f"trainable), {s.optim}, peft {s.peft}, dp {s.dp} x tp {s.tp} x pp {s.pp}, zero {s.zero}, "
                        f"{s.backend}, {s.dtype}")
    table.add_column("per device")
    table.add_column("GB", justify="right")
    built = "sharded" if s.sharded_init else "whole"
    for name, label in (("params", "params"), ("grads", "grads"), ("optimizer", "optimizer"),
                        ("activations", "activations"), ("buffers", "engine buffers"), ("train", "training step"),
                        ("load", f"load (built {built})"), ("peak", "peak")):
        table.add_row(label, f"{getattr(est, name) / GB:.2f}")
    print_wide(table)
    fits = "fits" if est.peak <= device_gb * GB else "does NOT fit"
    out.print(f"this layout ({s.dp * s.tp * s.pp} devices) {fits} on {device_gb:g} GB devices")
    out.print(f"devices needed (growing dp, tp {s.tp} x pp {s.pp}, zero {s.zero}): "
              + (str(need) if need else "none fits: use zero 3, more tp/pp, or activation checkpointing"))
