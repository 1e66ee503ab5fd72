"""The ``vtoken`` command: parsing its commands as the CLI does, without running them (committed results, doc
commands), and running it as a subprocess (the console script installed beside the test's Python)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


def vtoken_exe() -> str:
    """Path of the ``vtoken`` console script of the Python running the tests."""
    import sys

    return str(Path(sys.executable).with_name("vtoken"))


def run_vtoken(
    *args: str, timeout: float = 600, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run ``vtoken *args`` (text output captured, no check of the exit status; ``env`` replaces the
    environment when given) and return the finished process. Side effect: whatever the command does."""
    return subprocess.run([vtoken_exe(), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def last_json_line(proc: subprocess.CompletedProcess):
    """The JSON object a command printed as the last line of its standard output."""
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parse_vtoken(command: str) -> list[list[str]]:
    """The words of each ``&&``-joined part of ``command``, each parsed by the ``vtoken`` CLI (its command's
    options and values checked as click parses them; nothing runs). Raises click's ``UsageError`` (typer's
    copy of click) on an unknown option or a bad value, ``AssertionError`` on an unknown command."""
    import shlex

    import typer

    from vtoken.cli import app

    words, parts = shlex.split(command), [[]]
    for w in words:
        parts.append([]) if w == "&&" else parts[-1].append(w)
    for part in parts:
        assert part[:1] == ["vtoken"], f"not a vtoken command: {shlex.join(part)!r}"
        cmd, ctx, name, rest = typer.main.get_command(app), None, "vtoken", part[1:]
        while hasattr(cmd, "get_command"):  # a group: the next word names its subcommand
            ctx = cmd.context_class(cmd, info_name=name, parent=ctx)
            assert rest, f"{shlex.join(part)!r}: no subcommand after {name!r}"
            name, rest, cmd = rest[0], rest[1:], cmd.get_command(ctx, rest[0])
            assert cmd is not None, f"{shlex.join(part)!r}: no command {name!r}"
        cmd.make_context(name, rest, parent=ctx)
    return parts
