"""What the machine is doing to a cell: how busy the CPUs it may use were during each step (`CpuMeter`, figures
the training loop adds to each step's metrics record), and what a user is told from those records (`strain`):
that its recent steps run at less than half the rate of its first ones, or that other processes use the CPUs it
asked for. The progress line (tunelab.run.progress) and `exp status` (tunelab.report.status) both say it.

Figures, per step record (CPU runs only), over the last window of at least MIN_S seconds that ended at a step:
    cpu_set       the CPUs the process may run on (its affinity)
    cpu_asked     the threads the cell asked for on this node (its intra-op threads x its processes here)
    cpu_busy      how many of those CPUs were busy during the step, by anyone (/proc/stat)
    cpu_own       how many CPUs the cell used (this process's user + system time over the step, x its processes)
    cpu_pressure  the kernel's CPU pressure, "some avg10" (% of the last 10 s that a runnable task waited for a
                  CPU: its cgroup's cpu.pressure under cgroup v2, else /proc/pressure/cpu); None without PSI
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

WINDOW = 5  # steps compared: the first ones (after the very first, which warms up) against the most recent
SLOW = 0.5  # recent steps at less than this share of the first steps' rate: said
PRESSURE = 40.0  # % of time some task waited for a CPU (avg10): said
OTHERS = 0.5  # CPUs' worth of the cell's asked-for CPUs used by other processes: said
MIN_S = 1.0  # the shortest window a CPU figure is measured over


class CpuMeter:
    """The load on this process's CPUs since the last sample, for a cell of `ranks` processes on this node with
    `threads` intra-op threads each (they step in lockstep, so the cell's own use is this process's x ranks)."""

    def __init__(self, threads: int, ranks: int = 1, proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")):
        self.proc, self.asked, self.ranks = proc, threads * ranks, ranks
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.pressure_file = _pressure_file(proc, cgroup)
        self._last = self._read()
        self._said: dict[str, Any] = {}

    def _read(self) -> tuple[float, float | None, float]:
        t = os.times()
        return time.monotonic(), self._busy_ticks(), t.user + t.system

    def _busy_ticks(self) -> float | None:
        """Ticks the CPUs of its set spent on anything but idle and iowait since boot."""
        want, total = {f"cpu{c}" for c in self.cpus}, 0.0
        try:
            with (self.proc / "stat").open() as f:
                for line in f:
                    name, *ticks = line.split()
                    if name in want:
                        v = [int(x) for x in ticks[:8]]  # user nice system idle iowait irq softirq steal
                        total += sum(v) - v[3] - v[4]
        except (OSError, ValueError):
            return None
        return total

    def sample(self) -> dict[str, Any]:
        """The figures of the last window of at least MIN_S seconds (the kernel counts CPU time in ticks of 10 ms:
        a shorter window would be mostly rounding); {} before the first window closes."""
        t1, busy1, own1 = now = self._read()
        t0, busy0, own0 = self._last
        dt = t1 - t0
        if dt < MIN_S:
            return self._said
        self._last = now
        busy = (busy1 - busy0) / self.hz / dt if busy0 is not None and busy1 is not None else None
        self._said = {"cpu_set": len(self.cpus), "cpu_asked": self.asked,
                      "cpu_busy": None if busy is None else round(min(busy, len(self.cpus)), 2),
                      "cpu_own": round((own1 - own0) / dt * self.ranks, 2), "cpu_pressure": self.pressure()}
        return self._said

    def pressure(self) -> float | None:
        if self.pressure_file is None:
            return None
        try:
            for line in self.pressure_file.read_text().splitlines():
                if line.startswith("some "):
                    return float(dict(kv.split("=") for kv in line.split()[1:])["avg10"])
        except (OSError, ValueError, KeyError):
            pass
        return None


def _pressure_file(proc: Path, cgroup: Path) -> Path | None:
    """Its cgroup's cpu.pressure (cgroup v2: only its own tasks' waits), else the system's."""
    try:
        for line in (proc / "self" / "cgroup").read_text().splitlines():
            if line.startswith("0::"):
                own = cgroup / line[3:].strip().lstrip("/") / "cpu.pressure"
                if own.is_file():
                    return own
    except OSError:
        pass
    system = proc / "pressure" / "cpu"
    return system if system.is_file() else None


def strain(rows: list[dict[str, Any]]) -> str | None:
    """What is wrong with the machine, from a cell's step records (train/metrics.jsonl, or the Step events' own):
    a sentence with the figures, or None when its steps keep their pace and its CPUs are its own."""
    said = [s for s in (_slowdown(rows), _busy(rows)) if s]
    return "; ".join(said) or None


def _slowdown(rows: list[dict[str, Any]]) -> str | None:
    timed = [r for r in rows if (r.get("tokens_per_s") or 0) > 0 and "step" in r]
    w = min(WINDOW, (len(timed) - 1) // 2)
    if w < 2:
        return None
    first, recent = timed[1:1 + w], timed[-w:]
    before = statistics.median(r["tokens_per_s"] for r in first)
    now = statistics.median(r["tokens_per_s"] for r in recent)
    if now >= SLOW * before:
        return None
    return (f"steps {recent[0]['step']}-{recent[-1]['step']} ran at {now:.0f} tokens/s, {now / before:.2f}x the "
            f"{before:.0f} tokens/s of steps {first[0]['step']}-{first[-1]['step']}")


def _busy(rows: list[dict[str, Any]]) -> str | None:
    recent = [r for r in rows[-WINDOW:] if r.get("cpu_set")]
    if not recent:
        return None
    last = recent[-1]
    n, asked = last["cpu_set"], last.get("cpu_asked") or 1
    busy = [r["cpu_busy"] for r in recent if r.get("cpu_busy") is not None]
    own = statistics.median(r.get("cpu_own") or 0.0 for r in recent)
    pressures = [r["cpu_pressure"] for r in recent if r.get("cpu_pressure") is not None]
    pressure = statistics.median(pressures) if pressures else None
    others = max(0.0, statistics.median(busy) - own) if busy else None
    # Other processes took CPUs the cell asked for: more than the CPUs of its set it left free.
    taken = others is not None and others - max(0, n - asked) >= OTHERS
    if not taken and not (pressure is not None and pressure >= PRESSURE):
        return None
    parts = [f"its {n} CPU(s) were busier than it asked for ({asked} thread(s))"]
    if others is not None:
        parts.append(f"{statistics.median(busy):.1f} busy, {others:.1f} of them by other processes")
    if pressure is not None:
        parts.append(f"CPU pressure {pressure:.0f}% (tasks waited for a CPU that share of the last 10 s)")
    return ": ".join(parts[:1]) + (": " + ", ".join(parts[1:]) if parts[1:] else "")


class StepWindow:
    """The step records `strain` needs from a long run, without keeping them all: the first ones and the latest."""

    def __init__(self) -> None:
        self.first: list[dict[str, Any]] = []
        self.latest: deque[dict[str, Any]] = deque(maxlen=WINDOW)

    def add(self, row: dict[str, Any]) -> None:
        if len(self.first) < WINDOW + 1:
            self.first.append(row)
        else:
            self.latest.append(row)

    def rows(self) -> list[dict[str, Any]]:
        return [*self.first, *self.latest]
