"""The ``vtoken`` command line. Sub-commands live next to what they drive; this file only mounts them."""

from __future__ import annotations

from pathlib import Path

import typer

from vtoken.bench.cli import bench_app
from vtoken.models.cli import model_app  # light: heavy deps are imported lazily
from vtoken.serve.launch.cli import serve_app
from vtoken.sim.cli import simulate
from vtoken.sim.trace_cli import trace_app
from vtoken.vllm.offline.verify_cli import verify

app = typer.Typer(
    name="vtoken",
    help="Token-level virtualization of the paged KV cache (evict tokens, repack slots, free blocks).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """vToken: evict tokens, repack slots, return whole KV blocks to the pool."""


@app.command("policies")
def policies() -> None:
    """List the registered eviction policies."""
    import inspect

    from vtoken.policies import get_policy_class, policy_names

    typer.echo(f"{'policy':14s} {'lines':>5s}  {'file':28s} summary")
    for name in policy_names():
        cls = get_policy_class(name)
        path = inspect.getsourcefile(cls)
        lines = len(Path(path).read_text().splitlines())
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        typer.echo(f"{name:14s} {lines:5d}  {'vtoken/policies/' + path.rsplit('/', 1)[-1]:28s} {doc}")


@app.command("settings")
def settings(
    table: str = typer.Option("engine", help='engine (additional_config["vtoken"]) | serve (the vtoken.* keys)'),
    write: bool = typer.Option(False, "--write", help="regenerate the tables in the docs that include them"),
    check: bool = typer.Option(False, "--check", help="exit 1 when a doc's table is not the generated one"),
) -> None:
    """Print the settings table (key, default, meaning), generated from the config dataclasses' fields."""
    from pathlib import Path

    from vtoken.core.settings_doc import sync
    from vtoken.vllm.config import SETTINGS_DOCS, settings_tables

    tables = settings_tables()
    if not (write or check):
        if table not in tables:
            raise typer.BadParameter(f"{table!r}: one of {', '.join(tables)}", param_hint="--table")
        typer.echo(tables[table], nl=False)
        return
    root = Path(__file__).resolve().parents[1]
    stale = []
    for name in SETTINGS_DOCS:
        path = root / name
        text = path.read_text()
        if sync(text, tables) != text:
            stale.append(name)
            if write:
                path.write_text(sync(text, tables))
    for name in stale:
        typer.echo(f"{name}: {'regenerated' if write else 'settings table differs from `vtoken settings`'}", err=True)
    if check and stale and not write:
        raise typer.Exit(1)


app.command("simulate")(simulate)
app.command("verify")(verify)  # vtoken/vllm/offline/verify_cli.py (vLLM/transformers imported only when it runs)
app.add_typer(bench_app, name="bench")
app.add_typer(model_app, name="model")
app.add_typer(trace_app, name="trace")  # vtoken/sim/trace_cli.py
app.add_typer(serve_app, name="serve")  # vtoken/serve/launch/cli.py (Ray/vLLM imported only when it runs)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
