"""``vtoken model …`` and ``vtoken trace …``: prepare checkpoints, record attention traces.

Both are mounted by ``vtoken/cli.py``. Bad values exit with status 2 and a one-line message naming the
value (no traceback); the resolved model path is the only thing printed on stdout.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

MODEL_HELP = "default | smollm2 | tiny-llama | tiny-qwen2 | PATH to a Hugging Face checkpoint directory"

model_app = typer.Typer(help="Prepare the models vToken runs (converted/built once into the cache).",
                        no_args_is_help=True)
trace_app = typer.Typer(help="Record attention traces for the simulator.", no_args_is_help=True)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


def prepare_model(spec: str | None, cache_dir: Path | None = None) -> Path:
    """Resolve ``spec`` (building/converting if needed, with a spinner on stderr) or exit 2 with a message."""
    from rich.console import Console

    from vtoken.models.default import DEFAULT_ALIASES, ModelUnavailableError, is_converted, resolve_model

    slow = spec is None or (spec in DEFAULT_ALIASES and not is_converted(cache_dir))
    label = f"Preparing {spec}"
    if slow:
        label = "Converting SmolLM2-135M-Instruct (GGUF → safetensors, ~25 s, once)"
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


@trace_app.command("record")
def record(
    out: Path = typer.Option(..., "--out", "-o", help="Output .npz file (written atomically)."),
    model: str = typer.Option("default", "--model", "-m", help=MODEL_HELP),
    gen_len: int = typer.Option(128, "--gen-len", help="Greedy tokens generated per prompt."),
    prompt_len: int = typer.Option(384, "--prompt-len", help="Prompt tokens kept per text."),
    num_prompts: int = typer.Option(None, "--num-prompts", help="First N embedded texts (default: all)"),
    dtype: str = typer.Option("float16", "--dtype", help="Storage type of attention: float16 | float32."),
    cache_dir: Path = typer.Option(None, "--cache-dir", help="Cache root for named models."),
) -> None:
    """Record full-cache attention (mean over heads and layers) on the embedded prose texts."""
    from vtoken.sim.record import embedded_texts, record_traces

    for flag, value in (("--gen-len", gen_len), ("--prompt-len", prompt_len), ("--num-prompts", num_prompts)):
        if value is not None and value < 1:
            raise _fail(f"{flag} must be a positive integer, got {value}")
    if dtype not in ("float16", "float32"):
        raise _fail(f"--dtype must be float16 or float32, got {dtype!r}")
    if out.is_dir():
        raise _fail(f"--out {str(out)!r} is a directory; give a file name such as traces.npz")
    path = prepare_model(model, cache_dir)
    texts = embedded_texts()
    names = list(texts)[:num_prompts]
    start = time.perf_counter()
    try:
        record_traces(path, [texts[n] for n in names], gen_len, out, prompt_len=prompt_len, dtype=dtype,
                      source="vtoken/sim/texts: " + ", ".join(names), model_name=model)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    typer.echo(f"recorded {len(names)} traces ({prompt_len}+{gen_len} tokens) from {path} to {out} "
               f"in {time.perf_counter() - start:.1f} s", err=True)
    typer.echo(str(out))
