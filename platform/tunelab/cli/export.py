"""`exp export`: a finished cell as a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from tunelab.cli.common import EXPORT, RunsDir, app, err, interruptible, out, quiet_libraries


@app.command("export", rich_help_panel=EXPORT)
def export_cmd(
    cell: Annotated[str, typer.Argument(help="a done cell: its folder runs/<matrix>/<slug>-<id>/, or its name as the "
                                             "leaderboard prints it (slug, matrix/slug, or the start of its id)")],
    out_dir: Annotated[Path, typer.Option("--out", help="the folder to write (must not exist, unless --force)")],
    merge: Annotated[bool, typer.Option(help="fold a LoRA/DoRA/IA3 adapter into the base weights")] = False,
    dtype: Annotated[str, typer.Option(help="auto (keep the stored dtype), float32, bfloat16 or float16")] = "auto",
    force: Annotated[bool, typer.Option(help="replace --out if it exists (only once the new folder is complete)")]
    = False,
    runs_dir: RunsDir = Path("runs"),
) -> None:
    """Write a finished cell as a Hugging Face folder: weights (or adapter), tokenizer, model card."""
    from tunelab.folders.targets import resolve
    from tunelab.tools.export import export_cell

    cell_dir = resolve(cell, "export", ("cell",), runs_dir).cell.path

    quiet_libraries()
    with interruptible(f"nothing was written to {out_dir}"):
        kind, notes = export_cell(cell_dir, out_dir, merge=merge, dtype=dtype, force=force,
                                  log=lambda m: err.print(escape(m), highlight=False))
    for n in notes:
        err.print(f"[yellow]note:[/] {escape(n)}", highlight=False, soft_wrap=True)
    what = {"full": "full weights", "merged": "merged weights", "adapter": "adapter (needs peft)"}[kind]
    out.print(f"wrote {escape(str(out_dir))} ({what})", highlight=False)
