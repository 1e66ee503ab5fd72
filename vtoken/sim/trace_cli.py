"""``vtoken trace record``: record full-cache attention traces for the simulator (``vtoken.sim.record``).

Mounted by ``vtoken/cli.py`` as ``vtoken trace``. The model is resolved with ``vtoken.models.cli``'s
``prepare_model`` (which may build or convert it into the cache, with a spinner on stderr). Side effects:
writes the ``--out`` .npz file (atomically); prints a summary line on stderr and the output path on stdout.
Bad values exit with status 2 and a one-line message naming the value (no traceback). Importing this
module imports nothing heavy (torch/transformers load only when the command runs).
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

from vtoken.models.cli import _fail, prepare_model
from vtoken.models.default import MODEL_HELP

trace_app = typer.Typer(help="Record attention traces for the simulator.", no_args_is_help=True)


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
        record_traces(
            path,
            [texts[n] for n in names],
            gen_len,
            out,
            prompt_len=prompt_len,
            dtype=dtype,
            source="vtoken/sim/texts: " + ", ".join(names),
            model_name=model,
        )
    except ValueError as exc:
        raise _fail(str(exc)) from None
    typer.echo(
        f"recorded {len(names)} traces ({prompt_len}+{gen_len} tokens) from {path} to {out} "
        f"in {time.perf_counter() - start:.1f} s",
        err=True,
    )
    typer.echo(str(out))
