"""Where tunelab finds its content folders (data_recipes/, evals/, tasks/, experiments/), and what a model name that
is a path or a hub id looks like."""

from __future__ import annotations

import os
import re
from pathlib import Path

# An editable install or a checkout: platform/tunelab/core/paths.py -> the repository root.
REPO_ROOT = Path(__file__).resolve().parents[3]


def content_dirs(kind: str) -> list[Path]:
    """The working directory's folder first, so a project can add to or override what ships."""
    dirs = [Path.cwd() / kind, REPO_ROOT / kind]
    return [d for i, d in enumerate(dirs) if d.is_dir() and d.resolve() not in {x.resolve() for x in dirs[:i]}]


def find_named(kind: str, name: str, suffix: str = ".yaml") -> Path | None:
    """A path as given, or `name` + suffix in one of the content folders; None if neither (a name no path can
    have, such as one too long or with a NUL, is none)."""
    try:
        direct = Path(name).expanduser()
        if direct.is_file():
            return direct
        for d in content_dirs(kind):
            if (d / f"{name}{suffix}").is_file():
                return d / f"{name}{suffix}"
    except (OSError, ValueError, RuntimeError):  # ENAMETOOLONG, embedded NUL, ~user without a home
        return None
    return None


def available(kind: str, suffix: str = ".yaml") -> list[str]:
    return sorted({p.stem for d in content_dirs(kind) for p in d.glob(f"*{suffix}")})


def cache_dir() -> Path:
    """tunelab's cache (models, built datasets, offline eval data): $TUNELAB_CACHE or ~/.cache/tunelab."""
    return Path(os.environ.get("TUNELAB_CACHE") or Path.home() / ".cache" / "tunelab")  # (empty: unset, not cwd)


# A hub id is org/name: one slash. A name with more slashes, or that starts like a path, is a local folder.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_path(name: str) -> bool:
    """Whether a model name is a local path rather than an alias or a hub id (runs/m/cell/final has two slashes,
    so it is a path, though it starts with no ./)."""
    return name.startswith(("/", ".", "~")) or name.count("/") >= 2 or os.sep + os.sep in name
