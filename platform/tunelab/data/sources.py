"""Source readers: a recipe source -> a list of raw rows (dicts), plus what those rows depend on (for the cache).

Readers are registered by the key a source uses in YAML (`hub`, `path`, `generator`); local files are read
by suffix through FILE_READERS.
"""

from __future__ import annotations

import csv
import hashlib
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path

from tunelab.core.errors import UserError
from tunelab.core.files import read_jsonl
from tunelab.data.generators import GENERATORS


def _read_json(file: Path) -> list[dict]:
    data = json.loads(file.read_text())
    if not isinstance(data, list):
        raise ValueError("a .json source holds one list of records (use .jsonl for one record per line)")
    return data


def _read_parquet(file: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(file).to_pylist()


def _read_csv(file: Path) -> list[dict]:
    with file.open(newline="") as f:
        return list(csv.DictReader(f))


FILE_READERS: dict[str, Callable[[Path], list[dict]]] = {
    ".json": _read_json, ".jsonl": lambda file: read_jsonl(file, appended=False), ".parquet": _read_parquet,
    ".csv": _read_csv,
}


def source_file(src, recipe_path: Path) -> Path:
    return (recipe_path.parent / src.path).resolve()


def _path_rows(src, recipe_path: Path, where: str) -> list[dict]:
    file = source_file(src, recipe_path)
    reader = FILE_READERS.get(file.suffix.lower())
    if reader is None:
        raise UserError(f"cannot read {file.name!r}: the file types read are {', '.join(FILE_READERS)}",
                        file=recipe_path, key=f"{where}.path")
    if not file.is_file():
        raise UserError(f"file {str(file)!r} does not exist", file=recipe_path, key=f"{where}.path")
    try:
        return reader(file)
    except (ValueError, OSError) as e:
        raise UserError(f"could not read {str(file)!r}: {e}", file=recipe_path, key=f"{where}.path") from None


def _hub_rows(src, recipe_path: Path, where: str) -> list[dict]:
    from tunelab.core import hub_access

    hub = hub_access.prepare_hub()  # bounded requests; offline at once when the hub does not answer
    from datasets import load_dataset

    split = f"{src.split}[:{src.limit}]" if src.limit else src.split
    try:
        ds = load_dataset(src.hub, src.config, split=split, revision=src.revision)
    except Exception as e:  # noqa: BLE001 - offline, unknown id, bad config/split: all are the user's to fix
        raise UserError(f"could not load hub dataset {src.hub!r} (config {src.config!r}, split {src.split!r}): "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{f' ({hub})' if hub else ''} "
                        "-- without network access, download it elsewhere and point the source's 'path' at a local "
                        "copy",
                        file=recipe_path, key=f"{where}.hub") from None
    return ds.to_list()


def _generator_rows(src, recipe_path: Path, where: str) -> list[dict]:
    try:
        return GENERATORS[src.generator].load()(**src.args)
    except TypeError as e:
        raise UserError(f"generator {src.generator!r} rejected its args: {e}", file=recipe_path,
                        key=f"{where}.args") from None


READERS: dict[str, Callable[..., list[dict]]] = {"hub": _hub_rows, "path": _path_rows, "generator": _generator_rows}
KINDS = tuple(READERS)


def read_rows(src, recipe_path: Path, index: int) -> list[dict]:
    rows = READERS[src.kind](src, recipe_path, f"sources[{index}]")
    return rows[: src.limit] if src.limit else rows


def _file_digest(file: Path) -> str:
    h = hashlib.sha256()
    with file.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def source_fingerprint(src, recipe_path: Path) -> str:
    """What a source's rows depend on, for the dataset cache key: a local file's bytes, a generator's
    code and arguments, a hub dataset's id/config/split/revision (an unpinned revision can change under
    the same key: pin `revision` for reproducible caches)."""
    if src.path:
        file = source_file(src, recipe_path)
        return f"{file.name}:{_file_digest(file)}" if file.is_file() else str(file)
    if src.generator:
        code = inspect.getsource(sys.modules[GENERATORS[src.generator].load().__module__])  # its helpers too
        return hashlib.sha256(code.encode()).hexdigest()[:16]
    return f"{src.hub}:{src.config}:{src.split}:{src.revision}"
