"""setup(cfg) -> Layout: the process group and the (pp, dp, tp) DeviceMesh of this process."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tunelab.errors import UserError

DIMS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class Layout:
    device: torch.device
    mesh: object | None = None  # DeviceMesh with dims DIMS; None for one process
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


def setup(cfg) -> Layout:
    """Join the process group torchrun describes (or the one already joined) and build the mesh.

    One process and no process group: a Layout without a mesh, and every engine runs plain.
    """
    from tunelab.config import world_size

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
