"""How many threads a tunelab process runs torch with, and how its idle threads wait (docs/training.md, "Threads").

torch's default is every core of the machine, each OpenMP thread spinning while it waits for work: beside one
other such process on a 2-core machine a LoRA step ran 12x slower. So every torch process tunelab starts sizes
itself to the share of the machine it has:

    CPUs it may use  = its affinity (os.sched_getaffinity), capped by its cgroup's CPU quota (v2 cpu.max, v1
                       cpu.cfs_quota_us / cpu.cfs_period_us, at its own cgroup and every one above it)
    threads per cell = those CPUs // the cells its runner runs at once (`exp run --workers N`), at least 1;
                       a cell of several processes on this node divides them among its ranks

`--threads N` or the user's `OMP_NUM_THREADS` wins over that. The launcher (`shares`, `process_env`) puts the
count and the waiting policy into the child's environment before it starts, and the child (`start_process`, the
first thing `python -m tunelab.cell`, the checkpoint evaluator and `exp eval run` do) applies them before torch
loads its OpenMP runtime, which reads the waiting policy once, when it loads: idle threads spin a moment and then
sleep instead of spinning against other processes (libgomp's `GOMP_SPINCOUNT=3000`; another runtime
`OMP_WAIT_POLICY=PASSIVE`, Intel's `KMP_BLOCKTIME=0`). A user who sets any of those sets the policy alone.

Nothing here imports torch at module level: the runner (tunelab.run), which never imports torch, plans with it.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunelab.core.errors import UserError
from tunelab.machine import collector

# The launcher -> child: where the child's thread count came from and why, and the CPUs to pin itself to.
FROM_ENV = "TUNELAB_THREADS_FROM"  # auto | --threads | OMP_NUM_THREADS
WHY_ENV = "TUNELAB_THREADS_WHY"  # a sentence: "2 CPUs (affinity 0-1, no CPU quota) / 2 cells at once"
CPUS_ENV = "TUNELAB_CPUS"  # "0-1,4": this process pins itself to these CPUs before any thread starts
OWN_ENV = (FROM_ENV, WHY_ENV, CPUS_ENV)
# Any of these set by the user: the user sets the waiting policy, tunelab none of it.
WAIT_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
INTEROP = 1  # tunelab's CPU work is intra-op (no torch.jit.fork): more inter-op threads would only compete


@dataclass(frozen=True)
class Cpus:
    """The CPUs this process may use."""

    affinity: tuple[int, ...]  # the CPUs it may run on
    quota: float | None  # CPUs' worth of time its cgroups allow per period; None: no quota

    @property
    def count(self) -> int:
        """How many CPUs' worth it can use at once: the affinity, capped by the quota (rounded down, at least 1)."""
        n = len(self.affinity)
        return max(1, min(n, math.floor(self.quota + 1e-9))) if self.quota is not None else max(1, n)

    def describe(self) -> str:
        quota = f"a CPU quota of {self.quota:g}" if self.quota is not None else "no CPU quota"
        return f"{self.count} CPU(s) (affinity {cpu_list(self.affinity)}, {quota})"


@dataclass(frozen=True)
class Share:
    """What one cell started by a runner gets: intra-op threads per process and the CPUs it is pinned to."""

    threads: int
    source: str  # auto | --threads | OMP_NUM_THREADS
    why: str
    cpus: tuple[int, ...] = ()  # pinned to these; () = not pinned (it runs where its runner may)


def cpu_list(cpus: tuple[int, ...] | list[int]) -> str:
    """0,1,2,5 -> "0-2,5" (the kernel's cpulist format, which `parse_cpu_list` reads)."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in text.split(","):
        if part.strip():
            lo, _, hi = part.strip().partition("-")
            out += range(int(lo), int(hi or lo) + 1)
    return tuple(sorted(set(out)))


def cgroup_quota(proc: Path = Path("/proc"), root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The tightest CPU quota of this process's cgroups, in CPUs (None: none). A cgroup's limit binds every
    cgroup below it, so each level from the process's own up to the root counts; inside a container the
    process's path may name the host's hierarchy while the mount shows only the container's, so the mount's own
    root is read too."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: one hierarchy, the cpu controller's limit in cpu.max ("max 100000" or "Q P")
            for d in _levels(root, path):
                limits += _v2_limit(d / "cpu.max")
        elif "cpu" in controllers.split(","):  # v1: cpu.cfs_quota_us (-1: none) over cpu.cfs_period_us
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                for d in _levels(mount, path):
                    limits += _v1_limit(d)
    return min(limits) if limits else None


def _levels(mount: Path, path: str) -> list[Path]:
    """The process's cgroup folder and every one above it, up to the mount's root."""
    parts = [p for p in path.strip().split("/") if p]
    return [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _v2_limit(f: Path) -> list[float]:
    try:
        quota, period = f.read_text().split()[:2]
        return [] if quota == "max" else [int(quota) / int(period)]
    except (OSError, ValueError):
        return []


def _v1_limit(d: Path) -> list[float]:
    try:
        quota, period = int((d / "cpu.cfs_quota_us").read_text()), int((d / "cpu.cfs_period_us").read_text())
        return [quota / period] if quota > 0 and period > 0 else []
    except (OSError, ValueError):
        return []


def usable_cpus(proc: Path = Path("/proc"), root: Path = Path("/sys/fs/cgroup")) -> Cpus:
    affinity = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else tuple(
        range(os.cpu_count() or 1))
    return Cpus(affinity, cgroup_quota(proc, root))


def user_threads(env: Mapping[str, str] = os.environ) -> int | None:
    """OMP_NUM_THREADS as the user set it (its first level: OpenMP allows "4,2" for nested levels); None unset."""
    raw = env.get("OMP_NUM_THREADS", "").strip()
    if not raw:
        return None
    first = raw.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise UserError(f"OMP_NUM_THREADS={raw!r}: the threads of each torch process must be a whole number of at "
                        "least 1; unset it to let tunelab size them to this machine's share (docs/training.md, "
                        "\"Threads\"), or give `--threads N`", file="environment")
    return int(first)


def shares(workers: int = 1, threads: int | None = None, env: Mapping[str, str] = os.environ,
           cpus: Cpus | None = None) -> list[Share]:
    """One share per cell a runner runs at once: the threads of each (--threads, else the user's
    OMP_NUM_THREADS, else the usable CPUs // workers) and, with several at once, disjoint CPUs for each where
    the CPUs go round (workers x threads <= the affinity), else none (each runs where the runner may)."""
    cpus = cpus or usable_cpus()
    if threads is not None:
        n, source, why = threads, "--threads", f"--threads {threads}"
    elif (given := user_threads(env)) is not None:
        n, source, why = given, "OMP_NUM_THREADS", f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} as set"
    else:
        n, source = max(1, cpus.count // workers), "auto"
        why = f"{cpus.describe()} / {workers} cell(s) at once"
    pin = workers > 1 and workers * n <= len(cpus.affinity)
    if workers > 1 and not pin:
        why += f"; not pinned: {workers} x {n} threads is more than the {len(cpus.affinity)} CPUs of its affinity"
    return [Share(n, source, why, cpus.affinity[i * n:(i + 1) * n] if pin else ()) for i in range(workers)]


def process_env(share: Share, ranks: int = 1, keep: int | None = None,
                env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment one cell process (or each of its `ranks` on this node) starts with: its intra-op threads,
    the CPUs to pin itself to, and the waiting policy. An automatic share is divided among the ranks; `keep`: the
    count an earlier attempt of the cell trained with, which a resumed cell keeps (an automatic share only: the
    user's count wins), so every rung of a search's trial runs with the same threads (and the same rounding)."""
    n = share.threads if share.source != "auto" else max(1, share.threads // ranks)
    why = share.why + (f", / {ranks} processes of the cell" if share.source == "auto" and ranks > 1 else "")
    if share.source == "auto" and keep is not None and keep != n:
        n, why = keep, f"the {keep} thread(s) the cell's earlier attempt trained with (its share here: {n}; {why})"
    out = {"OMP_NUM_THREADS": str(n), FROM_ENV: share.source, WHY_ENV: why, **wait_env(env)}
    return {**out, CPUS_ENV: cpu_list(share.cpus)} if share.cpus else out


def beside_env(helpers: int, env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment of `helpers` processes started beside this one on its CPUs (checkpoint evaluators
    beside training): an automatic share is split among this process and them; a user's count holds for all."""
    mine = user_threads(env) or 1
    if env.get(FROM_ENV, "auto") != "auto":
        return {"OMP_NUM_THREADS": str(mine)}
    n = max(1, mine // (helpers + 1))
    return {"OMP_NUM_THREADS": str(n), FROM_ENV: "auto",
            WHY_ENV: f"beside training: 1/{helpers + 1} of the cell's {mine} thread(s)"}


def openmp_runtime() -> str | None:
    """The OpenMP runtime torch loads (libgomp: GNU; libiomp5: Intel; libomp: LLVM), found beside torch's
    libraries without importing torch; None when none is there (torch then uses the system's)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    for where in (spec.submodule_search_locations or []) if spec else []:
        names = [p.name for p in (Path(where) / "lib").glob("lib*omp*")]
        for lib in ("libgomp", "libiomp5", "libomp"):
            if any(n.startswith(lib + ".") or n.startswith(lib + "-") for n in names):
                return lib
    return None


# libgomp (torch's Linux wheels): idle threads spin GOMP_SPIN briefly, then sleep. Its default, 300,000 spins, took
# a LoRA step from 1.9 s alone to 4.8-14.9 s beside one other busy torch process on 2 cores; sleeping at once
# (PASSIVE, 0 spins) held it at 3.6-4.2 s beside but cost every step alone 1.5x (3.2-3.4 s). 3,000 spins: 2.6 s
# alone, 4.0 s beside (benchmarks/README.md, "A shared machine": more spins are faster alone, slower beside).
GOMP_SPIN = "3000"


def wait_env(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The waiting policy: idle OpenMP threads spin a moment, then sleep, rather than spin against other processes;
    unless the user set it. libgomp: GOMP_SPIN spins; another runtime (not measured here): PASSIVE, no spin."""
    if any(k in env for k in WAIT_KNOBS):
        return {}
    runtime = openmp_runtime()
    if runtime == "libgomp":
        return {"GOMP_SPINCOUNT": GOMP_SPIN}
    return {"OMP_WAIT_POLICY": "PASSIVE", **({"KMP_BLOCKTIME": "0"} if runtime == "libiomp5" else {})}


_RECORD: dict[str, Any] = {}


def start_process(threads: int | None = None) -> dict[str, Any]:
    """At the start of a torch process of tunelab's, before torch loads: pin it to the CPUs its launcher chose,
    set its waiting policy and thread count in the environment, then set torch's intra- and inter-op threads.
    `threads`: a command's `--threads`. -> what was set (env.json's "threads"). Also the garbage collector's
    quiet start and quick exit (machine/collector.py)."""
    collector.pause()
    pinned: tuple[int, ...] = ()
    note = None
    if os.environ.get(CPUS_ENV):
        want = parse_cpu_list(os.environ[CPUS_ENV])
        try:  # only this thread; every thread started later inherits it
            os.sched_setaffinity(0, want)
            pinned = want
        except (OSError, AttributeError) as e:
            note = f"not pinned to CPUs {cpu_list(want)}: {e}"
    if threads is not None:
        n, source, why = threads, "--threads", f"--threads {threads}"
    elif (given := user_threads()) is not None:
        source = os.environ.get(FROM_ENV, "OMP_NUM_THREADS")
        n, why = given, os.environ.get(WHY_ENV, f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} as set")
    else:
        share = shares(1)[0]
        n, source, why = share.threads, share.source, share.why
    # torch loaded already (an in-process command): its OpenMP runtime read the policy from the environment this
    # process started with, so it holds only if the launcher set it there
    in_effect = "torch" not in sys.modules or any(k in os.environ for k in WAIT_KNOBS)
    os.environ.update({"OMP_NUM_THREADS": str(n), FROM_ENV: source, WHY_ENV: why, **wait_env()})
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(INTEROP)
    except RuntimeError:  # set once per process, and only before inter-op work: torch keeps what it has
        pass
    _RECORD.clear()
    _RECORD.update(_described(source, why, pinned, note, policy_in_effect=in_effect))
    return dict(_RECORD)


def _described(source: str, why: str, pinned: tuple[int, ...], note: str | None, *,
               policy_in_effect: bool) -> dict[str, Any]:
    import torch

    return {"intra": torch.get_num_threads(), "interop": torch.get_num_interop_threads(), "source": source,
            "why": why, "cpus": cpu_list(tuple(sorted(os.sched_getaffinity(0)))) if hasattr(os, "sched_getaffinity")
            else None, "pinned": cpu_list(pinned) if pinned else None, "openmp": openmp_runtime(),
            "wait_policy": {k: os.environ[k] for k in WAIT_KNOBS if k in os.environ} or None,
            "policy_in_effect": policy_in_effect, **({"note": note} if note else {})}


def record() -> dict[str, Any]:
    """What this process set (start_process), or, in a process that did not size itself (a test calling a cell's
    stages in-process), what torch has, saying so."""
    if _RECORD:
        return dict(_RECORD)
    return _described("as found", "this process did not size its threads (tunelab.machine.threads.start_process "
                      "was not called)", (), None, policy_in_effect=False)
