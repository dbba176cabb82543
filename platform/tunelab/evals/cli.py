"""`exp eval ...`: run an evaluation suite on any model, and fetch what can be had offline."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True)
