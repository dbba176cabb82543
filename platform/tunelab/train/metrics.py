"""Measured resource figures: peak memory per device kind, and model FLOPs utilization (MFU)."""

from __future__ import annotations

import os
import resource

import torch

# Dense (no sparsity) bf16 tensor-core peak, FLOP/s, from the vendors' data sheets. First match wins, so
# the more specific names come first.
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM and NVL
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
]


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """(peak MB, what was measured): CUDA max allocated, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "peak_rss"


def peak_flops_of(device_name: str) -> float | None:
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in device_name), None)


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak (data sheet), or a CPU's measured fp32 matmul peak; None for a GPU not in
    the table."""
    if device.type == "cuda":
        return peak_flops_of(torch.cuda.get_device_name(device))
    return cpu_peak_flops() if device.type == "cpu" else None


_MEASURED: dict[str, float] = {}  # this process's peaks, cached or not


def cpu_peak_flops(size: int = 1024, repeats: int = 8) -> float:
    """What this host's CPU does at best on an fp32 matmul with torch's threads, measured once and cached
    (TUNELAB_CACHE/hosts/), so CPU runs report an MFU too. The best of a few timed runs: on a loaded machine
    that is below the idle peak, which makes MFU read high; the cache file says when it was measured."""
    import platform
    import time

    from tunelab.core.files import read_json, write_json
    from tunelab.core.paths import cache_dir

    threads = torch.get_num_threads()
    key = f"{platform.node()}-{platform.machine()}-{threads}threads-torch{torch.__version__}"
    path = cache_dir() / "hosts" / f"{key}.json"
    if str(path) in _MEASURED:
        return _MEASURED[str(path)]
    cached = read_json(path, dict)  # damaged: measured again
    if cached and cached.get("flops", 0) > 0:
        return float(cached["flops"])
    g = torch.Generator().manual_seed(0)  # its own generator: training's RNG streams stay untouched
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    a @ b  # warm up (threads, caches)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = max(best, 2 * size**3 / (time.perf_counter() - t0))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if load is None or load <= (os.cpu_count() or 1):  # a peak measured on a busy host is kept for this run only:
        # cached, it would stay too low for good and every later MFU would read high (above 1, seen here)
        write_json(path, {"flops": best, "threads": threads, "matmul": f"fp32 {size}x{size}",
                          "measured_at": time.time(), "load_average": load, "runs": repeats})
    _MEASURED[str(path)] = best
    return best


def mfu(n_params: int, tokens_per_s: float, peak: float | None) -> float | None:
    """6 N FLOPs per token (forward 2N, backward 4N) over the device's peak (peak_flops); attention FLOPs not
    counted."""
    if peak is None or tokens_per_s <= 0:
        return None
    used = 6 * n_params * tokens_per_s / peak
    return used if used <= 1 else None  # above the peak: the peak was under-measured (a busy CPU), not a number
