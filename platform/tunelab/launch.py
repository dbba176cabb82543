"""How a cell process is started: plain Python, torchrun (one node or many), or a SLURM batch script.

Multi-node goes through torchrun's own rendezvous; tunelab never writes a launcher of its own.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from tunelab.errors import UserError


@dataclass(frozen=True)
class Launch:
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # HOST:PORT of the rendezvous; required when nnodes > 1
    launcher: str = "local"  # local | slurm
    dry_run: bool = False  # slurm: write the script, do not submit
    gpus_per_node: int | None = None  # slurm: --gpus-per-node

    def check(self) -> None:
        if self.launcher not in ("local", "slurm"):
            raise UserError(f"--launcher {self.launcher!r}: allowed values are local, slurm")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise UserError(f"--node-rank {self.node_rank} must be in [0, --nnodes {self.nnodes})")
        if self.launcher == "slurm" and not self.dry_run and shutil.which("sbatch") is None:
            raise UserError("--launcher slurm: sbatch is not on PATH; add --dry-run to only write the scripts")
        if self.nnodes > 1 and self.launcher == "local" and not self.rdzv_endpoint:
            raise UserError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the rendezvous all nodes join)")


def procs_per_node(world_size: int, launch: Launch) -> int:
    if world_size % launch.nnodes:
        raise UserError(f"a layout of {world_size} processes does not split over --nnodes {launch.nnodes}")
    return world_size // launch.nnodes


def cell_command(run_dir: Path, world_size: int, launch: Launch | None = None) -> list[str]:
    """The command one node runs for a cell: the same entry point on every rank."""
    launch = launch or Launch()
    entry = ["-m", "tunelab.cell", str(run_dir)]
    if world_size == 1 and launch.nnodes == 1:
        return [sys.executable, *entry]
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={procs_per_node(world_size, launch)}"]
    if launch.nnodes == 1:
        torchrun.append("--standalone")
    else:
        torchrun += [f"--nnodes={launch.nnodes}", f"--node-rank={launch.node_rank}", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={launch.rdzv_endpoint}", f"--rdzv-id={run_dir.name}"]
    return [*torchrun, *entry]


def sbatch_script(run_dir: Path, world_size: int, launch: Launch, job_name: str) -> str:
    """One SLURM job per cell: one task per node, each running torchrun; node 0 hosts the rendezvous."""
    per_node = procs_per_node(world_size, launch)
    gpus = f"#SBATCH --gpus-per-node={launch.gpus_per_node}\n" if launch.gpus_per_node else ""
    torchrun = " ".join([
        shlex.quote(sys.executable), "-m", "torch.distributed.run", f"--nproc-per-node={per_node}",
        f"--nnodes={launch.nnodes}", "--node-rank=$SLURM_NODEID", "--rdzv-backend=c10d",
        '--rdzv-endpoint="$MASTER_ADDR:29500"', f"--rdzv-id={shlex.quote(run_dir.name)}",
        "-m", "tunelab.cell", shlex.quote(str(run_dir.resolve())),
    ])
    return (
        "#!/bin/bash\n"
        f"#SBATCH --job-name={job_name}\n"
        f"#SBATCH --nodes={launch.nnodes}\n"
        "#SBATCH --ntasks-per-node=1\n"
        f"{gpus}"
        f"#SBATCH --output={run_dir.resolve()}/slurm-%j.log\n"
        "set -euo pipefail\n"
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
        f"srun --kill-on-bad-exit=1 bash -c '{torchrun}'\n"
    )
