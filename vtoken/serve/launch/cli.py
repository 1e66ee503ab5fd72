"""``vtoken serve``: start the OpenAI-compatible server on this machine (``make serve``).

    vtoken serve                                   # default model on 127.0.0.1:8000, Ctrl-C stops it
    vtoken serve --model tiny-llama --mode none --set engine.kv_cache_blocks=64
    vtoken serve --config my_serve.yaml --port 8080
    vtoken serve show-config --set vtoken.policy=tova   # print the effective config as YAML, start nothing

The flags are shortcuts for keys of ``ServeAppConfig`` (docs/serving.md); ``--set key=value`` reaches
any key. The same config file works with ``VTOKEN_SERVE_CONFIG=file serve run serve_app:app``.
"""

from __future__ import annotations

from pathlib import Path

import typer

serve_app = typer.Typer(
    help="Serve vLLM + vToken on Ray Serve (OpenAI-compatible, loopback by default).",
    invoke_without_command=True,
    no_args_is_help=False,
)


def _config(
    config: Path | None,
    model: str | None,
    mode: str | None,
    policy: str | None,
    budget: str | None,
    replicas: int | None,
    sets: list[str],
):
    from pydantic import ValidationError

    from vtoken.serve.config import ServeAppConfig

    overrides: dict[str, object] = {}
    for flag, key in (
        (model, "model"),
        (mode, "vtoken.mode"),
        (policy, "vtoken.policy"),
        (budget, "vtoken.budget"),
        (replicas, "deployment.num_replicas"),
    ):
        if flag is not None:
            overrides[key] = flag
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"--set expects key=value, got {item!r}")
        overrides[key.strip()] = parse_scalar(value.strip())
    try:
        return ServeAppConfig.load(str(config) if config else None).merged(overrides)
    except (ValidationError, ValueError, OSError) as exc:
        typer.echo(f"invalid serve config: {exc}", err=True)
        raise typer.Exit(2) from None


def parse_scalar(text: str):
    import yaml

    return yaml.safe_load(text) if text else text


@serve_app.callback(invoke_without_command=True)
def serve(
    ctx: typer.Context,
    config: Path | None = typer.Option(None, "--config", "-c", help="ServeAppConfig YAML/JSON file"),
    model: str | None = typer.Option(None, help="'default', 'tiny-llama', a checkpoint dir"),
    mode: str | None = typer.Option(None, help="none | naive | repack | reuse+repack"),
    policy: str | None = typer.Option(None, help="eviction policy (vtoken policies)"),
    budget: str | None = typer.Option(None, help="fraction in (0, 1] or token count"),
    replicas: int | None = typer.Option(None, help="fixed replica count"),
    sets: list[str] = typer.Option([], "--set", help="any config key: section.key=value (repeatable)"),
    host: str = typer.Option("127.0.0.1", help="HTTP bind address (loopback unless you mean it)"),
    port: int = typer.Option(8000, min=1, max=65535, help="HTTP port"),
    dashboard: bool = typer.Option(False, help="start the Ray dashboard on 127.0.0.1"),
) -> None:
    """Start the server and block until Ctrl-C (then stop every replica and engine)."""
    cfg = _config(config, model, mode, policy, budget, replicas, sets)
    ctx.obj = cfg
    if ctx.invoked_subcommand is not None:
        return
    from vtoken.errors import ConfigError
    from vtoken.serve.launch.local import DeployFailedError, PortInUseError, port_is_free, run_local
    from vtoken.serve.replica.engine import preflight, resolve_model_path

    if not port_is_free(host, port):  # at once, before the preflight's vLLM imports (LocalCluster checks again)
        typer.echo(f"vtoken serve: {PortInUseError(host, port)}", err=True)
        raise typer.Exit(2)
    try:  # an engine configuration vToken refuses stops here, before Ray or any replica starts
        preflight(cfg, resolve_model_path(cfg.model))
    except ConfigError as exc:
        typer.echo(f"vtoken serve: {exc}", err=True)
        raise typer.Exit(2) from None

    try:
        run_local(cfg, host=host, port=port, dashboard=dashboard, echo=typer.echo)
    except (PortInUseError, DeployFailedError) as exc:  # nothing left running: run_local cleaned up
        typer.echo(f"vtoken serve: {exc}", err=True)
        raise typer.Exit(2) from None


@serve_app.command("show-config")
def show_config(ctx: typer.Context) -> None:
    """Print the effective ServeAppConfig as YAML (secrets masked) and exit."""
    import yaml

    typer.echo(yaml.safe_dump(ctx.obj.model_dump(mode="json"), sort_keys=False))


@serve_app.command("build-config")
def build_config(
    ctx: typer.Context, output: Path = typer.Option(Path("deploy/serve_config.yaml"), "--output", "-o")
) -> None:
    """Write the Serve config YAML (``serve build serve_app:app`` + name, env) for serve deploy/KubeRay."""
    from vtoken.serve.launch.deploy import serve_build_yaml

    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(serve_build_yaml(ctx.obj))
    typer.echo(f"wrote {output}")
