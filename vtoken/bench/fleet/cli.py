"""``vtoken bench fleet``: N replicas on paper. Mounted by ``vtoken/bench/cli.py``."""

from __future__ import annotations

import typer

from vtoken.bench.report import refuse
from vtoken.bench.settings import BUDGET_HELP

app = typer.Typer()


@app.command("fleet")
def fleet_cmd(
    replicas: int = typer.Option(256, help="replicas in the fleet (the autoscaler's max)"),
    loads: str = typer.Option("0.25,0.5,0.75,1,1.5,2", help="arrival rates × the naive fleet's capacity"),
    routers: str = typer.Option("kv,p2c,least_kv,round_robin", help="comma-separated router names"),
    modes: str = typer.Option("naive,repack", help="comma-separated reclamation modes: naive repack"),
    duration: float = typer.Option(40.0, help="simulated seconds of arrivals per run"),
    warmup: float = typer.Option(10.0, help="seconds of each run not measured"),
    pool_blocks: int = typer.Option(128, "--pool-blocks", help="KV pool of each replica (blocks)"),
    max_seqs: int = typer.Option(16, "--max-seqs", help="engine batch limit of each replica"),
    policy: str = typer.Option(None, help="eviction policy (default: fleet.model.BASE's)"),
    budget: str = typer.Option(None, help=BUDGET_HELP + " (default: fleet.model.BASE's)"),
    block_size: int = typer.Option(None, "--block-size", help="tokens per KV block (default: fleet.model.BASE's)"),
    steps: str = typer.Option("docs/results/fleet-steps.json", help="measured engine steps (JSON)"),
    measure_steps: bool = typer.Option(False, "--measure-steps", help="measure engine steps into --steps"),
    steps_model: str = typer.Option("tiny-llama", "--steps-model", help="model the steps are measured on"),
    time_scale: float = typer.Option(1.0, "--time-scale", help="multiply the measured step times"),
    target_load: float = typer.Option(0.5, "--target-load", help="load for 'replicas needed'"),
    ttft_slo: float = typer.Option(2.0, "--ttft-slo", help="seconds"),
    tpot_slo: float = typer.Option(0.2, "--tpot-slo", help="seconds per output token"),
    decision_sizes: str = typer.Option(
        "64,128,256,512,1024", "--decision-sizes", help="fleet sizes at which each router's decision is timed"
    ),
    seed: int = typer.Option(
        None, help="seeds the routers, the simulation and the policy (default: fleet.model.BASE's)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print the JSON only (else a table on stderr too)"),
    plot: str = typer.Option(None, help="write the plot (PNG) here"),
    out: str = typer.Option(None, help="also write the JSON here"),
    sets: list[str] = typer.Option(
        [],
        "--set",
        help="vtoken.KEY=VALUE: any setting of `vtoken settings`, over the flags (repeatable; not mode: --modes)",
    ),
) -> None:
    """Discrete-event fleet of N replicas: routers × modes × load, replicas needed, routing cost."""
    from pathlib import Path

    from vtoken.bench.fleet.bench import plot as draw
    from vtoken.bench.fleet.bench import run_fleet, summary
    from vtoken.bench.fleet.model import BASE, MODES, OWN, ROUTERS
    from vtoken.bench.report import emit
    from vtoken.bench.settings import configure
    from vtoken.errors import ConfigError
    from vtoken.serve.telemetry.sla import SloTargets

    try:
        cfg = configure(BASE, sets, own=OWN, policy=policy, budget=budget, block_size=block_size, seed=seed)
    except ConfigError as err:
        refuse(err)
    try:
        load_list = [float(x) for x in loads.split(",") if x.strip()]
        sizes = [int(x) for x in decision_sizes.split(",") if x.strip()]
    except ValueError:
        refuse(f"--loads {loads!r} / --decision-sizes {decision_sizes!r}: comma-separated numbers")
    chosen_r = [r.strip() for r in routers.split(",") if r.strip()]
    chosen_m = [m.strip() for m in modes.split(",") if m.strip()]
    checks = [
        (replicas < 1 or replicas > 4096, f"--replicas {replicas}: 1 … 4096"),
        (not load_list or min(load_list) <= 0, f"--loads {loads!r}: positive fractions"),
        (not chosen_r or set(chosen_r) - set(ROUTERS), f"--routers {routers!r}: valid: {', '.join(ROUTERS)}"),
        (not chosen_m or set(chosen_m) - set(MODES), f"--modes {modes!r}: valid are {', '.join(MODES)}"),
        (duration <= warmup or warmup < 0, f"--duration {duration} must exceed --warmup {warmup} (≥ 0)"),
        (pool_blocks < 8 or max_seqs < 1, f"--pool-blocks {pool_blocks} / --max-seqs {max_seqs}: ≥ 8 / ≥ 1"),
        (time_scale <= 0 or target_load <= 0, "--time-scale and --target-load must be > 0"),
        (ttft_slo <= 0 or tpot_slo <= 0, "--ttft-slo / --tpot-slo must be > 0"),
        (not sizes or min(sizes) < 1, f"--decision-sizes {decision_sizes!r}: positive integers"),
    ]
    for failed, message in checks:
        if failed:
            refuse(message)
    echo = (lambda *_: None) if as_json else (lambda line: typer.echo(line, err=True))
    report = run_fleet(
        replicas,
        load_list,
        chosen_r,
        chosen_m,
        duration,
        warmup,
        pool_blocks,
        max_seqs,
        cfg,
        Path(steps),
        measure_steps,
        steps_model,
        time_scale,
        target_load,
        SloTargets(ttft_slo, tpot_slo),
        tuple(sizes),
        echo,
    )
    if plot:
        draw(report, plot)
    if not as_json:
        typer.echo(summary(report), err=True)
    emit(report, out)
