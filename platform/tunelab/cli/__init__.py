"""`exp`: the command line. One module per group of verbs, each command only parsing its arguments and handing
over to the code that does the work:

    run.py       plan, run, status, clean          a matrix from its file to its run folder
    results.py   leaderboard, compare, report      the results of a run folder
    lookup.py    ls, models, memory                what a matrix can name, what a layout needs
    data.py      data build|stats|preview          recipes
    evaluate.py  eval run|pull, chat               any model on a suite, a conversation
    export.py    export                            a cell as a Hugging Face folder

Bad input ends in one paragraph on stderr and exit code 2 (`main`).
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.markup import escape

# Each group registers its commands when imported, in the order `exp --help` shows the panels.
from tunelab.cli import run  # noqa: F401  # isort: skip
from tunelab.cli import results, lookup, data  # noqa: F401  # isort: skip
from tunelab.cli import evaluate, export  # noqa: F401  # isort: skip
from tunelab.cli.common import app, err  # isort: skip
from tunelab.errors import UserError


def _print_version(value: bool) -> None:
    if value:
        from tunelab import __version__

        print(f"tunelab {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="print tunelab's version and exit")] = False,
) -> None:
    pass


def main() -> None:
    try:
        app()
    except UserError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:  # the cell marks itself pending; its checkpoints stay
        err.print("interrupted: run the same `exp run` again to continue (cells resume from their checkpoints)")
        sys.exit(130)


__all__ = ["app", "main"]
