"""``vtoken model …``: prepare checkpoints; ``prepare_model``/``_fail`` are shared with
``vtoken trace`` (``vtoken/sim/trace_cli.py``).

Mounted by ``vtoken/cli.py``. Side effects: ``prepare`` may build or convert a model into the cache (spinner
on stderr). Bad values exit with status 2 and a one-line message naming the value (no traceback); the
resolved model path is the only thing printed on stdout.
"""

from __future__ import annotations

from pathlib import Path

import typer

from vtoken.models.default import MODEL_HELP

model_app = typer.Typer(
    help="Prepare the models vToken runs (converted/built once into the cache).", no_args_is_help=True
)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


def prepare_model(spec: str | None, cache_dir: Path | None = None) -> Path:
    """Resolve ``spec`` (building/converting if needed, with a spinner on stderr) or exit 2 with a message."""
    from rich.console import Console

    from vtoken.models.default import (
        DEFAULT_ALIASES,
        GEMMA3_ALIASES,
        GEMMA3_DIRNAME,
        QWEN_ALIASES,
        QWEN_DIRNAME,
        ModelUnavailableError,
        is_converted,
        resolve_model,
    )

    label = f"Preparing {spec}"
    if spec is None or (spec in DEFAULT_ALIASES and not is_converted(cache_dir)):
        label = "Converting SmolLM2-135M-Instruct (GGUF → safetensors, ~25 s, once)"
    elif spec in GEMMA3_ALIASES and not is_converted(cache_dir, GEMMA3_DIRNAME):
        label = "Converting Gemma 3 270M (GGUF chunks → safetensors, ~90 s, once)"
    elif spec in QWEN_ALIASES and not is_converted(cache_dir, QWEN_DIRNAME):
        label = "Converting Qwen2.5-Coder-0.5B-Instruct (GGUF parts → safetensors, ~45 s, once)"
    try:
        with Console(stderr=True).status(label, spinner="dots"):
            return resolve_model(spec, cache_dir)
    except (ValueError, ModelUnavailableError) as exc:
        raise _fail(str(exc)) from None


@model_app.command("prepare")
def prepare(
    model: str = typer.Option("default", "--model", "-m", help=MODEL_HELP),
    cache_dir: Path = typer.Option(
        None, "--cache-dir", help="Cache root (default $VTOKEN_CACHE_DIR or ~/.cache/vtoken)."
    ),
) -> None:
    """Build or convert MODEL if needed and print its checkpoint directory."""
    typer.echo(str(prepare_model(model, cache_dir)))
