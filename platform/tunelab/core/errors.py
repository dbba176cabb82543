"""User-facing errors: one paragraph naming the file, the key path and what is allowed.

The CLI turns a `UserError` into that paragraph on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError


class UserError(Exception):
    """Bad input from the user: a message meant to be read, not a bug. `lines`: its problems one by one (key path:
    what), when it says several (`explain`), so that `Errors` can say each once."""

    def __init__(self, message: str, *, file: str | Path | None = None, key: str | None = None,
                 lines: list[str] | None = None):
        where = ": ".join(str(p) for p in (file, key) if p)
        super().__init__(f"{where}: {message}" if where else message)
        self.file = file
        self.lines = lines or [f"{key}: {message}" if key else message]


class Errors:
    """Every bad-input error of one file found in one pass, said together as one paragraph (a user fixes three
    typos in one go, not in three runs of `exp plan`): `with errors.collecting():` around each independent check,
    then `raise_any()`."""

    def __init__(self, file: str | Path):
        self.file = file
        self.lines: list[str] = []

    def add(self, e: UserError) -> None:
        same = e.file is None or str(e.file) == str(self.file)
        for said in e.lines:
            line = said if same else f"{e.file}: {said}"
            if line not in self.lines:
                self.lines.append(line)

    @contextmanager
    def collecting(self) -> Iterator[None]:
        try:
            yield
        except UserError as e:
            self.add(e)

    def __bool__(self) -> bool:
        return bool(self.lines)

    def raise_any(self) -> None:
        if len(self.lines) == 1:
            raise UserError(self.lines[0], file=self.file)
        if self.lines:
            raise UserError(f"{len(self.lines)} problems: " + "; ".join(self.lines), file=self.file,
                            lines=self.lines)


def read_text(path: str | Path, what: str = "file") -> str:
    """A user's text file, or the exit-2 paragraph saying why it cannot be read (missing, a folder, no
    permission, not UTF-8 text, any other OSError): the one place tunelab reads a file a user named."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"no such {what}", file=p) from None
    except IsADirectoryError:
        raise UserError(f"this is a folder; expected a {what}", file=p) from None
    except UnicodeDecodeError as e:
        raise UserError(f"not UTF-8 text (byte {e.start}: {e.reason}); save the {what} as UTF-8", file=p) from None
    except OSError as e:
        raise UserError(f"cannot read the {what}: {e.strerror or e}", file=p) from None


def env_number(name: str, default: float, *, least: float = 0.0, strict: bool = True, whole: bool = False,
               what: str = "a number", unset: str = "") -> float:
    """A number a user set in the environment (`default` when unset or empty): above `least` (`strict`) or at least
    it, a whole number when `whole` (`unset`: what leaving it unset means, if not the default). Anything else is
    the exit-2 paragraph naming the variable."""
    import math
    import os

    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(int(raw)) if whole else float(raw)
        ok = math.isfinite(value) and (value > least if strict else value >= least)
    except ValueError:
        ok = False
    if not ok:
        kind = "a whole number" if whole else what
        raise UserError(f"{name}={raw!r}: expected {kind} {'above' if strict else 'at least'} {least:g}; or unset it "
                        f"({unset or f'default {default:g}'})", file="environment")
    return value


def load_yaml(path: str | Path, what: str = "file") -> Any:
    """A user's YAML file, parsed; every way it can fail is a UserError naming the file (and the line)."""
    p = Path(path)
    text = read_text(p, what)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"YAML syntax error{where}: {problem}", file=p) from None
    except RecursionError:
        raise UserError("nested too deeply to read as YAML", file=p) from None


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str] | None:
    """The field names allowed at `loc` inside `model`, to list them in an unknown-key error."""
    cls: Any = model
    for part in loc:
        if isinstance(part, int) and get_origin(cls) is list:  # an item of a list of models
            cls = get_args(cls)[0]
            continue
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or part not in cls.model_fields:
            return None
        cls = cls.model_fields[part].annotation
        if get_origin(cls) is not None and get_origin(cls) is not list:  # Optional[X]: the model among the args
            cls = next((a for a in get_args(cls) if isinstance(a, type) and issubclass(a, BaseModel)), cls)
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return list(cls.model_fields)
    return None


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: where (a loc tuple inside the config), what, and the value given."""

    loc: tuple
    message: str
    value: Any = None


class Invalid(Exception):
    """Problems found by a plan-time check (tunelab.plan), to be explained against a file like pydantic errors."""

    def __init__(self, problems: list[Problem]):
        super().__init__("; ".join(f"{'.'.join(map(str, p.loc))}: {p.message}" for p in problems))
        self.problems = problems


def problems_of(err: ValidationError, model: type[BaseModel] | None) -> list[Problem]:
    """A pydantic error as Problems, naming the allowed keys where a key is unknown."""
    out = []
    for e in err.errors():
        loc = tuple(e["loc"])
        if e["type"] == "extra_forbidden":
            allowed = _fields_at(model, loc[:-1]) if model else None
            out.append(Problem(loc, "unknown key" + did_you_mean(str(loc[-1]), allowed or [])
                               + (f"; allowed keys: {', '.join(allowed)}" if allowed else "")))
        elif e["type"] == "missing":
            out.append(Problem(loc, "required key is missing"))
        else:
            out.append(Problem(loc, e["msg"].removeprefix("Value error, "), e.get("input")))
    return out


def did_you_mean(name: str, known: list[str]) -> str:
    """" (did you mean 'x'?)" for the known names closest to a mistyped one, else ""."""
    import difflib

    close = difflib.get_close_matches(name, known, n=3, cutoff=0.75)
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


def explain(
    err: ValidationError | Invalid,
    model: type[BaseModel] | None = None,
    *,
    file: str | Path,
    where: Callable[[tuple], str] = lambda loc: ".".join(map(str, loc)),
) -> UserError:
    """Turn pydantic errors or plan-time problems into a UserError; `where` maps a config loc to a key path
    in the file."""
    problems = err.problems if isinstance(err, Invalid) else problems_of(err, model)
    lines = []
    for p in problems:
        got = p.value
        shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
        lines.append(f"{where(p.loc)}: {p.message}{shown}")
    return UserError("; ".join(lines), file=file, lines=lines)
