"""Parsing ``vtoken`` commands as the CLI does, without running them (committed results, doc commands)."""

from __future__ import annotations


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
