"""What every `exp` command shares: the app, the consoles, the common options and how tables are printed.

Heavy imports (torch, transformers, the stages) stay inside the commands, so `exp --help` and the light
commands do not pay for them.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,  # ours: __init__.py
                  context_settings={"help_option_names": ["-h", "--help"]},  # subcommands inherit it
                  help="tunelab: instruction-tuning experiment matrices, trained, evaluated and tabulated.")

def _no_flag_types() -> None:
    """Typer prints a value type beside every option in -h, `<bool>` beside flags too; a flag takes no value,
    so there it is noise (typer has no setting for it)."""
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich

    def display(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    TyperOption.display_type_rich = display  # type: ignore[method-assign]


_no_flag_types()


def _console(stderr: bool = False) -> Console:
    """rich honours NO_COLOR (and FORCE_COLOR, TERM=dumb) from the environment. A terminal's lines wrap at its
    width; a pipe or log file has none, so there a line is printed whole (a path or a key stays greppable)."""
    console = Console(stderr=stderr)
    console.soft_wrap = not console.is_terminal
    return console


out = _console()
err = _console(stderr=True)

# `exp --help` lists commands by what a user does.
RUN, INSPECT, EVALUATE, EXPORT = "Run", "Inspect", "Evaluate", "Export"

RunsDir = Annotated[Path, typer.Option("--runs-dir", help="where runs/<matrix>/<cell>/ folders go")]
Json = Annotated[bool, typer.Option("--json", help="print JSON for programs instead of a table")]
Sets = Annotated[list[str] | None, typer.Option("--set", help="KEY=VALUE for every cell, over the file's own "
                                                "values (repeatable): --set model.name=tiny-random-llama")]
MatrixDir = Annotated[Path, typer.Argument(help="runs/<matrix> folder")]
Threads = Annotated[int | None, typer.Option(min=1, help="torch threads of each process (over OMP_NUM_THREADS); "
                                             "default: the CPUs it may use (affinity, CPU quota) / --workers")]


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


def print_wide(table: Table, console: Console | None = None) -> None:
    """Every value of a table in full, never an ellipsis inside a number or a label. A pipe or log file has no
    width: the table is printed at its natural width there. A terminal's width is respected: text wraps at its
    spaces, and when the columns cannot fit side by side even so they are printed in turns, each turn with the
    first column again (the row's name), so that no number is ever cut or folded."""
    console = console or out
    if not console.is_terminal:
        natural = Measurement.get(console, console.options.update_width(1_000_000), table).maximum
        return Console(width=max(natural, 20), file=console.file).print(table)
    for part in fitted(table, console):
        console.print(part)


def fitted(table: Table, console: Console) -> list[Table]:
    """The table as one or more tables no wider than the console, each with the first column and as many of the
    next ones as fit whole (a number never breaks: a right-aligned column keeps its width)."""
    for col in table.columns:
        whole = col.justify == "right"  # numbers: never broken across lines
        col.no_wrap = whole
        col.min_width = max((_longest(c, whole) for c in [col.header, *col.cells]), default=1)
        col.overflow = "fold"  # a word longer than the terminal is folded, never cut short with an ellipsis
    width, unbounded = console.width, console.options.update_width(1_000_000)

    def fits(t: Table) -> bool:
        return Measurement.get(console, unbounded, t).minimum <= width

    if fits(table) or len(table.columns) < 3:
        return [table]
    parts: list[list[int]] = []
    for i in range(1, len(table.columns)):
        if parts and fits(_part(table, [0, *parts[-1], i], "")):
            parts[-1].append(i)
        else:
            parts.append([i])
    return [_part(table, [0, *cols], table.title if n == 0 else f"{table.title or ''} (continued)")
            for n, cols in enumerate(parts)]


def _longest(cell: Any, whole: bool) -> int:
    """The narrowest a cell can be: its longest line (`whole`) or its longest word."""
    from rich.text import Text

    plain = Text.from_markup(cell).plain if isinstance(cell, str) else getattr(cell, "plain", "")
    return max((len(w) for w in (plain.splitlines() if whole else plain.split())), default=1)


def _part(table: Table, columns: list[int], title: Any) -> Table:
    part = Table(title=title, title_justify=table.title_justify, caption=table.caption)
    for i in columns:
        c = table.columns[i]
        part.add_column(c.header, justify=c.justify, no_wrap=c.no_wrap, overflow=c.overflow, style=c.style,
                        min_width=c.min_width)
    for r in range(table.row_count):
        part.add_row(*(list(table.columns[i].cells)[r] for i in columns))
    return part


def table(title: str, columns: list[str], rows: list[list[str]], right: frozenset[str] = frozenset()) -> Table:
    t = Table(title=title, title_justify="left")
    for col in columns:
        t.add_column(col, justify="right" if col in right else "left")
    for row in rows:
        t.add_row(*row)
    return t


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@contextmanager
def interruptible(what: str) -> Iterator[None]:
    """Ctrl-C ends a command with a line of its own saying what it left behind."""
    try:
        yield
    except KeyboardInterrupt:
        err.print(f"interrupted: {what}")
        raise typer.Exit(130) from None


def quiet_libraries() -> None:
    """transformers' per-file progress bars and advice, and other libraries' warnings, say nothing a user of
    export or chat needs (their own errors still end in exp's one-paragraph message)."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    logging.getLogger("torch").setLevel(logging.ERROR)


@contextmanager
def libraries_to(log: Path) -> Iterator[None]:
    """What third-party code prints on stderr while a command works (progress bars of loading and tokenizing,
    warnings, the `git` lm-eval runs for its provenance) goes to `log` instead of the terminal: file descriptor
    2 itself, so child processes' output too. tunelab's own output is on stdout; an error ends the block first,
    so its message still reaches the terminal."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with log.open("a") as f:
            os.dup2(f.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
