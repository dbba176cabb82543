"""The files a local lm-eval task folder (`eval.include_path`) makes an evaluation read, and their content digest.

An evaluation's id (config.EvalCfg.id) covers that content: a task YAML, its prompt code or its data that
changed is scored again, where the same settings over other files would otherwise read as done.

A task's `dataset_kwargs.data_files` names its data; a relative name is found beside the YAML that names it
first, then in the include_path folder, then where exp runs (lm-eval's own rule, kept for YAMLs written for it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

_DIGESTS: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) -> sha256: each file read once per process


class _Tolerant(yaml.SafeLoader):
    """Reads lm-eval's task YAMLs, whose `!function utils.x` tags name code: a tag is kept as its text."""


_Tolerant.add_multi_constructor("!", lambda loader, suffix, node: None)


def data_file(written: str, yaml_dir: Path, root: Path | None = None) -> Path:
    """Where a data file named in a task YAML is: beside the YAML, else in the include_path folder, else where exp
    runs; the first that exists (beside the YAML when none does)."""
    path = Path(written).expanduser()
    if path.is_absolute():
        return path
    candidates = [yaml_dir / path, *([root / path] if root else []), Path.cwd() / path]
    return next((c for c in candidates if c.is_file()), candidates[0])


def written_files(spec: Any) -> Iterator[tuple[str, str]]:
    """(split, file as written) of a task config's dataset_kwargs.data_files: a name, a list, or a mapping of
    split -> name or list."""
    kwargs = spec.get("dataset_kwargs") if isinstance(spec, dict) else None
    files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    groups = files.items() if isinstance(files, dict) else [("", files)]
    for split, names in groups:
        for name in names if isinstance(names, list) else [names]:
            if isinstance(name, str) and name:
                yield str(split), name


def _yamls(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.y*ml") if p.suffix in (".yaml", ".yml") and _shown(p, root))


def _shown(path: Path, root: Path) -> bool:
    """Not inside a hidden folder or a cache of compiled code."""
    return not any(part.startswith(".") or part == "__pycache__" for part in path.relative_to(root).parts[:-1])


def files(include_path: str) -> list[Path]:
    """Every file the folder's tasks may read: the folder's own files (YAMLs, prompt code, data) and the data files
    its YAMLs name elsewhere."""
    root = Path(include_path).expanduser()
    if not root.is_dir():
        return []
    found = {p for p in root.rglob("*") if p.is_file() and _shown(p, root) and not p.name.startswith(".")}
    for y in _yamls(root):
        try:
            spec = yaml.load(y.read_text(encoding="utf-8"), Loader=_Tolerant)  # noqa: S506 - a SafeLoader
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        found |= {f for _, name in written_files(spec) if (f := data_file(name, y.parent, root)).is_file()}
    return sorted(found)


def _digest(path: Path) -> str:
    try:
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        if key not in _DIGESTS:
            h = hashlib.sha256()
            with path.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            _DIGESTS[key] = h.hexdigest()
        return _DIGESTS[key]
    except OSError:
        return "unreadable"


def digest(include_path: str) -> str:
    """A content hash of every file `files` finds (names relative to the folder where they lie in it)."""
    root = Path(include_path).expanduser()
    if not root.is_dir():
        return "missing"
    h = hashlib.sha256()
    for f in files(include_path):
        name = str(f.relative_to(root)) if f.is_relative_to(root) else str(f.resolve())
        h.update(f"{name}\0{_digest(f)}\n".encode())
    return h.hexdigest()[:16]
