"""`exp`: the command line. One module per group of verbs, each command only parsing its arguments and handing
over to the code that does the work:

    run.py       plan, run, status, clean          a matrix from its file to its run folder
    results.py   leaderboard, compare, report      the results of a run folder
    lookup.py    ls, models, memory                what a matrix can name, what a layout needs
    data.py      data build|stats|preview          recipes
    evaluate.py  eval run|pull, chat               any model on a suite, a conversation
    export.py    export                            a cell as a Hugging Face folder
    tune.py      tune status                       the searches of a matrix's tune: section

Bad input ends in one paragraph on stderr and exit code 2 (`main`).

May import: core, folders, optimizers, plan, machine, data, models, train, evals, report, checkpoint_scores, tools,
matrix, run, cell, tune, experiment.
"""

from __future__ import annotations

import functools
import sys
from typing import Annotated, Any

import typer
import typer.main
from rich.markup import escape

# Each group registers its commands when imported, in the order `exp --help` shows the panels.
from tunelab.cli import run  # noqa: F401  # isort: skip
from tunelab.cli import results, lookup, data  # noqa: F401  # isort: skip
from tunelab.cli import evaluate, export, tune  # noqa: F401  # isort: skip
from tunelab.cli.common import app, err  # isort: skip
from tunelab.core.errors import UserError
from tunelab.machine import collector

SHELLS = ("bash", "zsh", "fish", "powershell", "pwsh")


def _shell(value: str) -> str:
    if value not in SHELLS:
        raise typer.BadParameter(f"{value!r}: allowed are {', '.join(SHELLS)}")
    return value


def _show_completion(ctx: typer.Context, value: str | None) -> None:
    if value:
        from typer.completion import get_completion_script

        prog = ctx.find_root().info_name or "exp"
        print(get_completion_script(prog_name=prog, complete_var=f"_{prog.replace('-', '_').upper()}_COMPLETE",
                                    shell=_shell(value)))
        raise typer.Exit()


def _install_completion(value: str | None) -> None:
    if value:
        from typer.completion import install

        shell, path = install(shell=_shell(value))
        print(f"{shell} completion installed in {path}; it takes effect in a new terminal")
        raise typer.Exit()


def _print_version(value: bool) -> None:
    if value:
        from tunelab import __version__

        print(f"tunelab {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="print tunelab's version and exit")] = False,
    show_completion: Annotated[str | None, typer.Option(
        "--show-completion", metavar="SHELL", callback=_show_completion, is_eager=True,
        help=f"print the completion script for SHELL ({', '.join(SHELLS)})")] = None,
    install_completion: Annotated[str | None, typer.Option(
        "--install-completion", metavar="SHELL", callback=_install_completion, is_eager=True,
        help="install completion for SHELL")] = None,
) -> None:
    pass


def _say(e: Exception) -> None:
    err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)


@functools.cache
def _command(commands: int, groups: int) -> Any:  # typer's own click Command
    """The click command tree typer builds from the app (once per set of commands: building it reads every
    command's signature, which costs more than most commands take)."""
    # With add_completion=False typer never registers its shell classes, and <TAB> (the _EXP_COMPLETE call the
    # installed hook makes) answers "Shell bash not supported".
    import typer.completion

    typer.completion.completion_init()

    return typer.main.get_command(app)


def main() -> None:
    """The boundary: bad input is one paragraph on stderr and exit code 2, never a traceback. UserError is how
    tunelab says it; a file or folder of the user's that the system refused (OSError with its name) is said
    the same way wherever it surfaced."""
    try:
        collector.check_env()
        collector.quick_exit()  # every `exp` command: no walk of the heap at exit (machine/collector.py)
        _command(len(app.registered_commands), len(app.registered_groups))()
    except UserError as e:
        _say(e)
        sys.exit(2)
    except OSError as e:
        if e.filename is None:
            raise
        what = f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 else "")
        _say(UserError(f"{e.strerror or e} (the system refused this file or folder); check the path and its "
                       "permissions, then run again", file=what))
        sys.exit(2)
    except RuntimeError as e:  # pathlib's expanduser on '~name' for a user this machine does not have
        if "home directory" not in str(e):
            raise
        _say(UserError(f"{e}: a path beginning with '~name' names a user this machine does not know; give the "
                       "path without it, then run again"))
        sys.exit(2)
    except KeyboardInterrupt:  # the cell marks itself pending; its checkpoints stay
        err.print("interrupted: run the same `exp run` again to continue (cells resume from their checkpoints)")
        sys.exit(130)


__all__ = ["app", "main"]
