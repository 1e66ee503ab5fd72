"""The commands README.md and docs/*.md show run as written, where that is cheap (issue 25).

Every ``vtoken serve …`` line of a fenced shell block is run with ``show-config`` (the whole config is
validated, nothing starts): a documented command that exits 2 fails here. Every ``vtoken bench SUB …`` and
``vtoken verify …`` line is parsed by the CLI as it would run it (``support.cli.parse_vtoken``: every option
and value checked, nothing runs).
The commands themselves (minutes to hours of benchmarks) run where their results are produced.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
from support.cli import parse_vtoken
from support.paths import ROOT

SHELL_TAGS = ("", "bash", "sh", "shell", "console")
USER_FILES = ("my.yaml", "my-serve.yaml")  # placeholders for the reader's own config file
VTOKEN = [sys.executable, "-m", "vtoken.cli"]


def fenced_shell_blocks(text: str) -> list[str]:
    """The bodies of the fenced blocks tagged bash/sh/shell/console or untagged, in order (pure)."""
    blocks, body, lang = [], None, None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if body is None:
                body, lang = [], line.strip()[3:].strip()
            else:
                if lang in SHELL_TAGS:
                    blocks.append("\n".join(body))
                body = None
        elif body is not None:
            body.append(line)
    return blocks


def documented_commands() -> list[tuple[str, str]]:
    """``(file, command)`` for every line of a fenced shell block that runs ``vtoken`` (backslash
    continuations joined; leading ``VAR=value`` words, a trailing ``# comment`` dropped; lines with ``...``
    placeholders skipped)."""
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in fenced_shell_blocks(path.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.split(r"\s+#\s", line.strip().removeprefix("$ "))[0].strip()
                words = line.split()
                while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                    words = words[1:]
                if words[:1] != ["vtoken"] or "..." in line or "…" in line:
                    continue
                out.append((path.relative_to(ROOT).as_posix(), " ".join(words)))
    return out


COMMANDS = documented_commands()
SERVE = [
    (f, c)
    for f, c in COMMANDS
    if c.split()[1] == "serve"
    and not {"show-config", "build-config"} & set(c.split())
    and not any(u in c.split() for u in USER_FILES)
]
OTHERS = [(f, c) for f, c in COMMANDS if c.split()[1] in ("bench", "verify", "simulate")]


def test_the_docs_show_commands_to_check():
    assert len(SERVE) >= 1 and len(OTHERS) >= 20, (SERVE, OTHERS)


@pytest.mark.parametrize(("doc", "command"), SERVE, ids=[c for _, c in SERVE])
def test_documented_serve_command_validates(doc, command):
    args = shlex.split(command)[1:]
    args = [a for a in args if a not in ("--dry-run",)]
    out = subprocess.run([*VTOKEN, *args, "show-config"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, f"{doc}: `{command}` is refused:\n{out.stderr[-1500:]}"


@pytest.mark.parametrize(("doc", "command"), OTHERS, ids=[c[:80] for _, c in OTHERS])
def test_documented_bench_and_verify_options_exist(doc, command):
    """Parsed by the CLI as it would run it (options and values checked; nothing runs)."""
    parse_vtoken(command)
