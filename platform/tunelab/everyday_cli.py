"""`exp export`, `exp chat`, `exp clean`: what a user does after a matrix has run.

Thin commands over tunelab.export, tunelab.chat and tunelab.clean; cli.py registers them. Heavy imports
stay inside the commands so `exp --help` and `exp clean` do not pay for torch.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tunelab.errors import UserError

out = Console()
err = Console(stderr=True)


@contextmanager
def _interruptible(what: str):
    """Ctrl-C ends these commands with a line of its own (exp's handler speaks of resuming `exp run`)."""
    try:
        yield
    except KeyboardInterrupt:
        err.print(f"interrupted: {what}")
        raise typer.Exit(130) from None


def _quiet_loading() -> None:
    """transformers' per-file progress bars say nothing a user of these commands needs."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def export_cmd(
    cell_dir: Annotated[Path, typer.Argument(help="a done cell's folder, runs/<matrix>/<slug>-<id>/")],
    out_dir: Annotated[Path, typer.Option("--out", help="the folder to write (must not exist, unless --force)")],
    merge: Annotated[bool, typer.Option(help="fold a LoRA/DoRA/IA3 adapter into the base weights")] = False,
    dtype: Annotated[str, typer.Option(help="auto (keep the stored dtype), float32, bfloat16 or float16")] = "auto",
    force: Annotated[bool, typer.Option(help="replace --out if it exists (only once the new folder is complete)")]
    = False,
) -> None:
    """Write a finished cell as a Hugging Face folder: weights (or adapter), tokenizer, model card."""
    from tunelab.export import export_cell

    _quiet_loading()
    with _interruptible(f"nothing was written to {out_dir}"):
        kind, notes = export_cell(cell_dir, out_dir, merge=merge, dtype=dtype, force=force,
                                  log=lambda m: err.print(escape(m), highlight=False))
    for n in notes:
        err.print(f"[yellow]note:[/] {escape(n)}", highlight=False, soft_wrap=True)
    what = {"full": "full weights", "merged": "merged weights", "adapter": "adapter (needs peft)"}[kind]
    out.print(f"wrote {escape(str(out_dir))} ({what})", highlight=False)


def chat_cmd(
    target: Annotated[str, typer.Argument(help="a done cell's folder, an export, a catalog alias, a folder or a "
                                               "hub id")],
    prompt: Annotated[str | None, typer.Option(help="answer this one message and exit (no terminal needed)")] = None,
    system: Annotated[str | None, typer.Option(help="a system message that starts the conversation")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="most tokens per answer")] = 256,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy, else sampling temperature")] = 0.7,
    template: Annotated[str, typer.Option(help="auto (the template a cell trained with, else the tokenizer's chat "
                                               "template, else alpaca), chat, alpaca or plain")] = "auto",
    device: Annotated[str, typer.Option(help="auto, cpu or cuda")] = "auto",
) -> None:
    """Talk to a model, its answers streamed token by token."""
    from tunelab import chat

    if device not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device {device!r}: allowed are auto, cpu, cuda")
    if template not in chat.TEMPLATE_CHOICES:  # before the model loads, which takes a while
        raise UserError(f"--template {template!r}: allowed are {', '.join(chat.TEMPLATE_CHOICES)}")
    from tunelab.runtime import device_of as device_for

    _quiet_loading()
    with _interruptible("chat ended"):
        model, tok, trained, label = chat.load_target(target, device_for(device))
        name, note = chat.choose_template(template, tok, trained)
        if note:
            err.print(f"[dim]{escape(note)}", highlight=False, soft_wrap=True)
        chat.session(model, tok, name, system=system, max_new_tokens=max_new_tokens, temperature=temperature,
                     prompt=prompt, label=label, info=lambda m: err.print(f"[dim]{escape(m)}", highlight=False))


def clean_cmd(
    root: Annotated[Path, typer.Argument(help="runs/, runs/<matrix>/ or one cell folder")],
    checkpoints: Annotated[bool, typer.Option("--checkpoints", help="delete checkpoints/ of done cells (the "
                                              "default when neither flag is given)")] = False,
    failed: Annotated[bool, typer.Option("--failed", help="delete failed cells' folders (they rerun from "
                                         "scratch)")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask for confirmation")] = False,
) -> None:
    """Free disk: show what would go and how much, ask, then delete. Locked (running) cells are left alone."""
    from tunelab import clean
    from tunelab.cellfolder import human_bytes

    items = clean.plan(root, checkpoints=checkpoints or not failed, failed=failed)
    if not items:
        out.print("nothing to clean")
        return
    table = Table(title=f"exp clean {root}")
    for col in ("cell", "state", "delete", "bytes", "size"):
        table.add_column(col, justify="right" if col in ("bytes", "size") else "left")
    for i in items:
        what = "checkpoints/" if i.target != i.cell else "the cell folder"
        table.add_row(escape(i.label), i.state, f"[dim]left alone: {i.skip}" if i.skip else what, str(i.size),
                      human_bytes(i.size))
    out.print(table)
    todo = [i for i in items if not i.skip]
    total = sum(i.size for i in todo)
    if not todo:
        out.print("nothing to clean: every match is locked")
        return
    out.print(f"{len(todo)} deletion(s), {total} bytes ({human_bytes(total)})", highlight=False)
    if not yes and not typer.confirm("delete?", default=False):
        err.print("nothing deleted")
        raise typer.Exit(1)
    done = [i for i in todo if clean.delete(i)]
    for i in todo:
        if i not in done:
            err.print(f"{escape(i.label)}: left alone, it was locked or changed state meanwhile", highlight=False)
    clean.refresh_leaderboards(done)
    freed = sum(i.size for i in done)
    out.print(f"freed {freed} bytes ({human_bytes(freed)})", highlight=False)
