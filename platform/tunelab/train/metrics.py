"""Measured resource figures: peak memory per device kind, and model FLOPs utilization (MFU)."""

from __future__ import annotations

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
    """The device's dense bf16 peak, or None for a CPU or a GPU not in the table."""
    return peak_flops_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def mfu(n_params: int, tokens_per_s: float, peak: float | None) -> float | None:
    """6 N FLOPs per token (forward 2N, backward 4N) over the device's peak; attention FLOPs not counted."""
    if peak is None or tokens_per_s <= 0:
        return None
    return 6 * n_params * tokens_per_s / peak
