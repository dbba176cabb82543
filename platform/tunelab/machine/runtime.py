"""The one place where a cell's "auto" settings meet the machine: `Runtime`, resolved once and passed down.

    layout = setup(cfg.parallel)          # the process group and the (pp, dp, tp) DeviceMesh of this process
    rt = resolve(cfg, layout)             # + device, weights dtype, attention kernel, autocast precision
    check_host(cfg)                       # what the plan could not know: CUDA, flash-attn, local folders

Stages take what they need from `rt` (models.load, train.run, the engines) and never resolve "auto" again.

The machine can also ask a cell to stop: a scheduler sends SIGUSR1 (SLURM's `--signal`, before the time
limit) or SIGTERM (preemption). `catch_stop_signals` turns them into a request the training loop honours at
the next step boundary, on every rank at once (`stop_agreed`): it writes a checkpoint and raises `Preempted`.
"""

from __future__ import annotations

import importlib.util
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tunelab.core.config import CellConfig, ModelCfg, ParallelCfg, world_size
from tunelab.core.errors import UserError
from tunelab.core.registries import MODELS, PEFT, uses_engine

DIMS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class Layout:
    device: torch.device
    mesh: Any = None  # a DeviceMesh with dims DIMS; None for one process
    pp: int = 1
    dp: int = 1
    tp: int = 1

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.distributed else 0

    @property
    def is_main(self) -> bool:
        """The one process that writes files and events."""
        return self.rank == 0

    def coord(self, dim: str) -> int:
        """This process's index along a mesh dim (0 for one process)."""
        return self.mesh[dim].get_local_rank() if self.distributed else 0

    def group(self, dim: str):
        return self.mesh[dim].get_group() if self.distributed else None


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def setup(cfg: ParallelCfg) -> Layout:
    """Join the process group torchrun describes (or the one already joined) and build the mesh.

    One process and no process group: a Layout without a mesh, and every engine runs plain.
    """
    need = world_size(cfg)
    if need == 1 and not dist.is_initialized():
        return Layout(device=_device())
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized():
        if env_world != need:
            raise UserError(f"the layout dp {cfg.dp} x tp {cfg.tp} x pp {cfg.pp} needs {need} processes but "
                            f"this process was started as one of {env_world}; start it with "
                            f"`torchrun --nproc-per-node {need}` (or the runner does)", key="parallel")
        device = _device()
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    else:
        device = _device()
    if dist.get_world_size() != need:
        raise UserError(f"the layout needs {need} processes, the process group has {dist.get_world_size()}",
                        key="parallel")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (cfg.pp, cfg.dp, cfg.tp), mesh_dim_names=DIMS)
    return Layout(device=device, mesh=mesh, pp=cfg.pp, dp=cfg.dp, tp=cfg.tp)


@dataclass(frozen=True)
class Runtime:
    layout: Layout
    dtype: torch.dtype  # the weights' dtype
    attn: str  # transformers' attn_implementation
    precision: str  # autocast of the one-process step: "bf16" or "fp32" (engines run in the weights' dtype)

    @property
    def device(self) -> torch.device:
        return self.layout.device

    @property
    def world_size(self) -> int:
        return self.layout.pp * self.layout.dp * self.layout.tp

    @property
    def is_main(self) -> bool:
        return self.layout.is_main


def device_of(name: str) -> torch.device:
    """train.device (auto, cpu, cuda) on this machine."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def model_settings(cfg: ModelCfg, device: torch.device | str) -> tuple[torch.dtype, str]:
    """(weights dtype, attention kernel). dtype auto: bfloat16 on a CUDA device that supports it, else float32.
    attn auto: flash_attention_2 when flash-attn is importable, the device is CUDA and the weights are 16-bit;
    sdpa otherwise."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    name = cfg.dtype
    if name == "auto":
        name = "bfloat16" if cuda and torch.cuda.is_bf16_supported() else "float32"
    dtype = getattr(torch, name)
    has_flash = importlib.util.find_spec("flash_attn") is not None
    attn = cfg.attn
    if attn == "auto":
        attn = "flash_attention_2" if cuda and has_flash and dtype in (torch.bfloat16, torch.float16) else "sdpa"
    elif attn == "flash_attention_2" and not (cuda and has_flash):
        raise UserError(f"flash_attention_2 needs a CUDA device and the flash-attn package (pip install "
                        f"flash-attn); here the device is {device} and flash-attn is "
                        f"{'installed' if has_flash else 'not installed'}. Use auto, sdpa or eager.",
                        key="model.attn")
    return dtype, attn


def precision_of(cfg: CellConfig, device: torch.device, engine: bool, dtype: torch.dtype) -> str:
    """train.precision: auto = bf16 autocast on a CUDA device with bf16, else fp32. Engines run the model in
    its own dtype without autocast, so theirs is what the weights are."""
    if engine:
        return "bf16" if dtype == torch.bfloat16 else "fp32"
    if cfg.train.precision != "auto":
        return cfg.train.precision
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def resolve(cfg: CellConfig, layout: Layout | None = None) -> Runtime:
    """The runtime of a cell on this process; without a layout, one plain process on train.device."""
    if layout is None or not layout.distributed:
        layout = Layout(device=device_of(cfg.train.device))
    dtype, attn = model_settings(cfg.model, layout.device)
    engine = layout.distributed or uses_engine(cfg.parallel)
    return Runtime(layout=layout, dtype=dtype, attn=attn, precision=precision_of(cfg, layout.device, engine, dtype))


def host_problems(cfg: CellConfig) -> list[str]:
    """What this machine lacks for the cell (checked where it runs, and by `exp run` before it starts any)."""
    out = []
    name = cfg.model.name
    if name not in MODELS and name.startswith(("/", ".", "~")) and not Path(name).expanduser().is_dir():
        out.append(f"model.name: {name!r} is no folder on this machine")
    cuda = torch.cuda.is_available()
    if cfg.train.device == "cuda" and not cuda:
        out.append("train.device: cuda, and this machine has no CUDA device")
    if PEFT[cfg.peft.method].needs_cuda and not cuda:
        out.append(f"peft.method: {cfg.peft.method} quantizes the base model to 4 bits with bitsandbytes, which needs "
                   "a CUDA device, and this machine has none; use lora or dora here, or run the cell on a GPU machine")
    if cfg.peft.method == "qlora" and importlib.util.find_spec("bitsandbytes") is None:
        out.append("peft.method: qlora needs the bitsandbytes package: pip install bitsandbytes")
    if cfg.model.attn == "flash_attention_2" and (not cuda or importlib.util.find_spec("flash_attn") is None):
        out.append("model.attn: flash_attention_2 needs a CUDA device and the flash-attn package")
    return out


def check_host(cfg: CellConfig, file: str | Path | None = None) -> None:
    problems = host_problems(cfg)
    if problems:
        raise UserError("this machine cannot run the cell: " + "; ".join(problems), file=file)


# -- stop requests (preemption) ---------------------------------------------------------------------------------


class Preempted(Exception):  # noqa: N818 - a request, not an error
    """A stop signal ended the cell; `step` is the step whose checkpoint was written (None: before training or
    after it, nothing new to save)."""

    def __init__(self, signal_name: str, step: int | None = None):
        super().__init__(f"stopped by {signal_name}" + (f" after step {step} (checkpoint written)" if step else ""))
        self.signal_name, self.step = signal_name, step
        self.handled = False  # the cell process has requeued its job (SLURM) already


class Paused(Exception):  # noqa: N818 - a planned stop, not an error
    """Training reached the step this run was asked to stop at (a search's rung: tunelab.tune), validated there
    and wrote that step's checkpoint; a later run continues from it exactly as if it had never stopped."""

    def __init__(self, step: int):
        super().__init__(f"paused at step {step} (checkpoint written)")
        self.step = step


@dataclass
class _Stop:
    installed: bool = False
    signal: str | None = None  # the name of the signal received
    armed: bool = False  # the training loop runs: stop at its next step boundary (elsewhere: at once)
    interrupts: int = 0  # SIGINTs received: the first is a stop request, the second stops at once
    raised: bool = False  # a Preempted was raised: a later request is the same stop, said once


STOP = _Stop()
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def catch_stop_signals() -> None:
    """Every process of a cell calls this (the same way), so that `stop_agreed` is a collective they all run.
    SIGUSR1 and SIGTERM (a scheduler, the runner passing on a Ctrl-C) and a first SIGINT (Ctrl-C) ask for a
    stop at the next step boundary, with a checkpoint; a second SIGINT stops at once (KeyboardInterrupt)."""
    def handler(signum: int, frame: object) -> None:
        STOP.signal = STOP.signal or signal.Signals(signum).name
        # Raised once: a terminal's Ctrl-C reaches the cell and the runner, which passes it on as SIGTERM, and a
        # second Preempted would cut short the handling of the first (the cell's status unwritten). A request
        # during training (armed) raises nothing, so one outside it later still stops at once.
        if not STOP.armed and not STOP.raised:
            STOP.raised = True
            raise Preempted(STOP.signal)

    def interrupt(signum: int, frame: object) -> None:
        STOP.interrupts += 1
        if STOP.interrupts > 1:
            raise KeyboardInterrupt
        handler(signum, frame)

    for s in STOP_SIGNALS:
        signal.signal(s, handler)
    signal.signal(signal.SIGINT, interrupt)
    STOP.installed, STOP.raised = True, False


def stop_agreed(layout: Layout) -> bool:
    """Whether any process of the layout got a stop signal; the same answer on all of them (one all-reduce).
    Without catch_stop_signals (library use, tests) always False and no collective."""
    if not STOP.installed:
        return False
    flag = torch.tensor([1.0 if STOP.signal else 0.0], device=layout.device)
    if layout.distributed:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
