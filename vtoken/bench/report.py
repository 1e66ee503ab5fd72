"""How every ``vtoken bench …`` command hands back what it measured, or refuses its input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NoReturn

import typer


def emit(report: dict, out: str | None) -> None:
    """Print ``report`` as JSON on stdout; with ``out``, also write the same JSON there (one file)."""
    text = json.dumps(report, indent=2)
    if out:
        Path(out).write_text(text + "\n")
    typer.echo(text)


def refuse(message: object) -> NoReturn:
    """Bad input: print ``error: message`` on stderr and exit 2 (no traceback, nothing on stdout)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)
