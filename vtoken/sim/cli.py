"""``vtoken simulate``: retained KV blocks per reclamation mode, from a trace replay.

Contract (other tools parse it): with ``--json`` one JSON object on stdout with ``policy``, ``budget``,
``block_size``, ``requests``, ``packing_bound_mean`` and ``modes.{none,naive,repack,reuse+repack}``
each with ``retained_blocks_mean``, ``peak_blocks`` and, for the moving modes, ``moves_total`` and
``moves_lower_bound``. Bad values exit with status 2 and a message naming the value. ``--granularity block``
(whole original blocks) runs on the exact engine: it is the default engine then, and ``--engine fast``
is refused with a message naming ``--engine exact``.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import typer

from vtoken.core.config import SET_HELP, Budget, Granularity, parse_sets
from vtoken.errors import ConfigError
from vtoken.sim.result import MODES


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def simulate(
    policy: str = typer.Option(None, help="eviction policy (see `vtoken policies`; default: SimConfig's)"),
    budget: str = typer.Option(None, help="fraction of the context in (0, 1], or a token count (default: SimConfig's)"),
    block_size: int = typer.Option(
        None, "--block-size", help="tokens per KV block, a power of two (default: SimConfig's)"
    ),
    prompt_len: int = typer.Option(512, "--prompt-len"),
    gen_len: int = typer.Option(256, "--gen-len", help="decode steps"),
    requests: int = typer.Option(64),
    seed: int = typer.Option(None, help="the random policy's and the synthetic attention's (default: SimConfig's)"),
    sinks: int = typer.Option(None, help="first tokens never evicted (default: SimConfig's)"),
    recent: int = typer.Option(None, help="last tokens never evicted (default: SimConfig's)"),
    trigger: str = typer.Option(None, help="step | block (default: SimConfig's)"),
    granularity: str = typer.Option(
        None, help="token | block (whole original blocks; exact engine; default: SimConfig's)"
    ),
    engine: str = typer.Option(
        None, help="fast (batched) | exact (the core objects, slow); default: fast, exact with --granularity block"
    ),
    workers: int = typer.Option(1, help="processes for the fast engine"),
    traces: Path = typer.Option(None, help=".npz of recorded attention (`vtoken trace record`); default synthetic"),
    keep_mass: float = typer.Option(
        None,
        "--keep-mass",
        help="adaptive budget: keep this share of the attention mass (h2o, tova, snapkv; exact engine)",
    ),
    window: int = typer.Option(None, help="a hybrid model's sliding window: also report the whole pool"),
    window_groups: int = typer.Option(
        0, "--window-groups", help="its sliding-window KV cache groups (Gemma 3 270M: 5, window 512)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print the JSON contract only"),
    plot: Path = typer.Option(None, help="write a PNG of mean retained blocks per decode step and mode"),
    sets: list[str] = typer.Option([], "--set", help=SET_HELP + " (not mode: every mode runs)"),
) -> None:
    """Replay attention through policy + token table + every reclamation mode; report retained blocks."""
    from vtoken.sim.run import SimConfig, run_simulation

    if traces is not None and not traces.is_file():
        _fail(f"--traces {str(traces)!r}: no such file")
    try:
        flags = {
            "policy": policy,
            "budget": None if budget is None else Budget.parse(budget),
            "block_size": block_size,
            "seed": seed,
            "sinks": sinks,
            "recent": recent,
            "trigger": trigger,
            "granularity": granularity,
            "keep_mass": keep_mass,
        }  # None: not given, SimConfig's default
        settings = {**{k: v for k, v in flags.items() if v is not None}, **parse_sets(sets)}
        if "mode" in settings:
            raise ConfigError("--set vtoken.mode: the simulator runs every reclamation mode")
        default = SimConfig.__dataclass_fields__["vtoken"].default
        block = Granularity.parse(settings.get("granularity", default.granularity)) is Granularity.BLOCK
        cfg = SimConfig.of(
            prompt_len=prompt_len,
            gen_len=gen_len,
            requests=requests,
            workers=workers,
            traces=traces,
            window=window,
            window_groups=window_groups,
            engine=engine or ("exact" if block else "fast"),
            **settings,
        )
        out, tally = _run_with_progress(cfg, run_simulation, quiet=as_json)
    except ConfigError as err:
        _fail(str(err))
    out["command"] = "vtoken " + shlex.join(sys.argv[1:]) if sys.argv and "vtoken" in sys.argv[0] else None
    if plot is not None:
        _plot(tally.mean_series(), out, plot)
    if as_json:
        typer.echo(json.dumps(out))
        return
    _print_table(out)
    if plot is not None:
        typer.echo(f"plot written to {plot}")


def _run_with_progress(cfg, run, quiet: bool):
    if quiet:
        return run(cfg)
    from rich.progress import BarColumn, Progress, TimeElapsedColumn, TimeRemainingColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        "{task.completed}/{task.total}",
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        transient=True,
    ) as bar:
        task = bar.add_task(f"simulating {cfg.vtoken.policy}", total=cfg.requests)
        return run(cfg, on_requests=lambda n: bar.advance(task, n))


def _print_table(out: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"{out['policy']} budget={out['budget']} B={out['block_size']} "
        f"requests={out['requests']} prompt={out['prompt_len']} gen={out['gen_len']}"
    )
    for col in ("mode", "retained blocks (mean)", "vs naive", "peak", "moves", "lower bound"):
        t.add_column(col, justify="right")
    for m in MODES:
        e = out["modes"][m]
        vs = f"{e['vs_naive_pct']:+.1f}%" if "vs_naive_pct" in e else ""
        t.add_row(
            m,
            f"{e['retained_blocks_mean']:.2f}",
            vs,
            str(e["peak_blocks"]),
            str(e.get("moves_total", "")),
            str(e.get("moves_lower_bound", "")),
        )
    t.add_row("packing bound", f"{out['packing_bound_mean']:.2f}", "", "", "", "")
    Console().print(t)
    if out.get("pool"):  # a hybrid model: the sliding-window groups' blocks come on top in every mode
        pool = out["pool"]
        typer.echo(
            f"whole pool ({out['window_groups']} sliding-window groups of window {out['window']}: "
            f"+{pool['sliding_blocks_mean']:.2f} blocks per request): "
            + ", ".join(
                f"{m} {e['pool_blocks_mean']:.2f}" + (f" ({e['vs_naive_pct']:+.1f}%)" if "vs_naive_pct" in e else "")
                for m, e in pool["modes"].items()
            )
        )
    typer.echo(f"{out['seconds']:.2f} s ({out['engine']} engine, {out['source']} attention)")


def _plot(series: dict, out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ys in series.items():
        ax.plot(range(1, len(ys) + 1), ys, label=name, linestyle="--" if name == "packing_bound" else "-")
    ax.set_xlabel("decode step")
    ax.set_ylabel("retained KV blocks per request (mean)")
    ax.set_title(f"{out['policy']} budget {out['budget']}, block size {out['block_size']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
