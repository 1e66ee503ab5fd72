"""How every ``vtoken bench …`` command hands back what it measured."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def emit(report: dict, out: str | None) -> None:
    """Print ``report`` as JSON on stdout; with ``out``, also write the same JSON there (one file)."""
    text = json.dumps(report, indent=2)
    if out:
        Path(out).write_text(text + "\n")
    typer.echo(text)
