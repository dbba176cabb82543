"""How a cell process is started: plain Python, torchrun (one node or many), or a SLURM batch script.

Multi-node goes through torchrun's own rendezvous; tunelab never writes a launcher of its own.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tunelab.core.errors import UserError
from tunelab.core.files import StateFileDamaged
from tunelab.folders.cell import CellFolder
from tunelab.machine.threads import Share, process_env, shares
from tunelab.matrix.launcher import SlurmCfg

# A run of a cell that trains only up to this step, then validates, checkpoints and stops (a search's rung,
# tunelab.tune), and the steps at which it measures validation loss on the way (every rung of its search): how
# far one run goes and what it measures there is not what the cell is, so it travels beside the config.
STOP_AT_ENV = "TUNELAB_STOP_AT"
VALIDATE_AT_ENV = "TUNELAB_VALIDATE_AT"


def stop_at_from_env() -> int | None:
    value = os.environ.get(STOP_AT_ENV)
    return int(value) if value else None


def validate_at_from_env() -> tuple[int, ...]:
    return tuple(int(s) for s in os.environ.get(VALIDATE_AT_ENV, "").split(",") if s.strip())


def run_env(stop_at: int | None, validate_at: tuple[int, ...]) -> dict[str, str]:
    """The environment that tells a cell process how far to train and where to validate (empty: all of it)."""
    out = {STOP_AT_ENV: str(stop_at)} if stop_at is not None else {}
    return {**out, VALIDATE_AT_ENV: ",".join(map(str, validate_at))} if validate_at else out


def threads_env(share: Share | None, ranks: int, folder: CellFolder) -> dict[str, str]:
    """The threads, CPUs and waiting policy of a cell's processes on this node (tunelab.machine.threads), from
    its share (None: this machine's, one cell at a time). A cell that ran before keeps the thread count its
    env.json says it ran with, so every rung of a search's trial rounds alike (docs/tuning.md)."""
    try:
        earlier = folder.env()
    except StateFileDamaged:  # the cell's own start-up rewrites env.json, or fails saying why
        earlier = {}
    keep = (earlier.get("threads") or {}).get("intra")
    return process_env(share or shares(1)[0], ranks, keep if isinstance(keep, int) and keep > 0 else None)


@dataclass(frozen=True)
class Launch:
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # HOST:PORT of the rendezvous; required when nnodes > 1
    launcher: str = "local"  # local | slurm
    dry_run: bool = False  # slurm: write the script, do not submit
    slurm: SlurmCfg = field(default_factory=SlurmCfg)  # the matrix file's launcher section (+ command line)

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
        # The static rendezvous numbers ranks by --node-rank, so global rank 0 (the process that writes the
        # cell's files, under the lock its runner holds) is on node 0; c10d's would order nodes by address and
        # pid, putting it on whichever node sorts first.
        torchrun += [f"--nnodes={launch.nnodes}", f"--node-rank={launch.node_rank}", "--rdzv-backend=static",
                     f"--rdzv-endpoint={launch.rdzv_endpoint}", f"--rdzv-id={run_dir.name}"]
    return [*torchrun, *entry]


def worker_command(name: str, run_dirs: list[Path], mode: str = "exact") -> list[str]:
    """A together-group's process (cell/group.py): its members' folders, in member order; `mode`: exact or batched."""
    batched = ["--mode", "batched"] if mode == "batched" else []
    return [sys.executable, "-m", "tunelab.cell", "--together", "--name", name, *batched, *map(str, run_dirs)]


def _sbatch_lines(launch: Launch, job_name: str, output: str, array: int | None) -> list[str]:
    s = launch.slurm
    opts = [f"--job-name={job_name}", f"--nodes={launch.nnodes}", "--ntasks-per-node=1", f"--output={output}",
            "--open-mode=append",  # a requeued job appends to its log
            "--requeue", f"--signal=USR1@{s.signal_grace_s}"]
    opts += [f"--{k.replace('_', '-')}={v}" for k, v in (("partition", s.partition), ("time", s.time),
             ("account", s.account), ("qos", s.qos), ("gpus_per_node", s.gpus_per_node),
             ("cpus_per_task", s.cpus_per_task), ("mem", s.mem)) if v is not None]
    if array is not None:
        opts.append(f"--array=0-{array - 1}")
    return [f"#SBATCH {o}" for o in [*opts, *s.sbatch]]


def sbatch_script(run_dirs: list[Path], world_size: int, launch: Launch, job_name: str) -> str:
    """One SLURM job for one cell, or a job array over several cells of the same process count: one task per
    node, each running torchrun (node 0 hosts the rendezvous) or, for one process, the cell itself.

    Preemption: SLURM sends SIGUSR1 `signal_grace_s` before the time limit to every process of the job (and
    SIGTERM when it preempts). The cell's processes checkpoint at the next step boundary, mark the cell
    pending and requeue the job (`scontrol requeue`), which runs this script again and resumes from that
    checkpoint. The batch shell and torchrun's agent ignore SIGUSR1 (its default action would kill them);
    the cell's processes install their own handler (tunelab.machine.runtime.catch_stop_signals)."""
    dirs = [shlex.quote(str(d.resolve())) for d in run_dirs]
    array = len(dirs) if len(dirs) > 1 or launch.slurm.array else None
    output = (f"{run_dirs[0].resolve().parent}/slurm-%A_%a.log" if array else f"{run_dirs[0].resolve()}/slurm-%j.log")
    per_node = procs_per_node(world_size, launch)
    # Run by each node's task inside single quotes, so the variables expand there (SLURM_NODEID differs).
    python = f'"{sys.executable}"'
    if world_size == 1 and launch.nnodes == 1:
        run = f'{python} -m tunelab.cell "$RUN_DIR"'
    elif launch.nnodes == 1:  # torchrun finds a free port itself
        run = f'{python} -m torch.distributed.run --standalone --nproc-per-node={per_node} -m tunelab.cell "$RUN_DIR"'
    else:
        run = " ".join([
            python, "-m", "torch.distributed.run", f"--nproc-per-node={per_node}",
            f"--nnodes={launch.nnodes}", "--node-rank=$SLURM_NODEID", "--rdzv-backend=c10d",
            '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"', '--rdzv-id="$SLURM_JOB_ID"',
            "-m", "tunelab.cell", '"$RUN_DIR"'])
    lines = ["#!/bin/bash", *_sbatch_lines(launch, job_name, output, array), "set -euo pipefail",
             "trap '' USR1  # for the cell's processes: they checkpoint and requeue", *launch.slurm.setup]
    if array:
        lines += [f"RUN_DIRS=({' '.join(dirs)})", 'RUN_DIR="${RUN_DIRS[$SLURM_ARRAY_TASK_ID]}"']
    else:
        lines.append(f"RUN_DIR={dirs[0]}")
    lines += ["export RUN_DIR",
              'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
              "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))  # jobs sharing a node do not collide",
              f"srun --kill-on-bad-exit=1 bash -c 'trap \"\" USR1; exec {run}'"]
    return "\n".join(lines) + "\n"
