"""Measured resource figures: peak memory per device kind."""

from __future__ import annotations

import resource

import torch


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """(peak MB, what was measured): CUDA max allocated, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "peak_rss"
