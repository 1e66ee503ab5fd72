"""``vtoken bench …``: benchmarks that print what they measured as JSON, with the command that produced it.

Speed and memory targets live here, compared side by side in one run, never as timed tests.
"""

from __future__ import annotations

import typer

bench_app = typer.Typer(help="Benchmarks (JSON out, with the command that produced it).", no_args_is_help=True)


@bench_app.command("sim-scale")
def sim_scale(
    requests: int = typer.Option(10_000),
    prompt_len: int = typer.Option(8_064, "--prompt-len"),
    gen_len: int = typer.Option(128, "--gen-len"),
    policy: str = typer.Option("h2o"),
    budget: str = typer.Option("0.2"),
    block_size: int = typer.Option(32, "--block-size"),
    workers: int = typer.Option(1),
    out: str = typer.Option(None, help="also write the JSON here"),
) -> None:
    """The simulator at scale: R requests × (prompt + gen) tokens, every mode, wall time measured."""
    from vtoken.bench.sim_scale import run_sim_scale

    run_sim_scale(requests, prompt_len, gen_len, policy, budget, block_size, workers, out)


@bench_app.command("retained")
def retained(
    policies: str = typer.Option("h2o,scissorhands,random", help="comma-separated policy names"),
    budgets: str = typer.Option("0.2,0.5", help="comma-separated budgets"),
    block_sizes: str = typer.Option("16,32", "--block-sizes", help="comma-separated block sizes"),
    prompt_len: int = typer.Option(384, "--prompt-len"),
    gen_len: int = typer.Option(128, "--gen-len"),
    requests: int = typer.Option(64),
    traces: str = typer.Option(None, help=".npz of recorded attention; default synthetic"),
    sinks: int = typer.Option(4),
    recent: int = typer.Option(16),
    markdown: bool = typer.Option(False, help="also print a markdown table"),
) -> None:
    """Retained KV blocks per mode for a grid of policies × budgets × block sizes (vs the paper's range)."""
    from vtoken.bench.retained import run_retained

    run_retained(policies, budgets, block_sizes, prompt_len, gen_len, requests, traces, sinks, recent, markdown)


@bench_app.command("overhead")
def overhead_cmd(
    model: str = typer.Option("tiny-llama", help="default | tiny-llama | tiny-qwen2 | PATH"),
    block_size: int = typer.Option(32, "--block-size"),
    batch: int = typer.Option(8, help="concurrent requests"),
    prompt_len: int = typer.Option(256, "--prompt-len"),
    gen_len: int = typer.Option(64, "--gen-len"),
    budget: float = typer.Option(0.5, help="budget fraction for the evicting variants"),
    repeats: int = typer.Option(3, help="runs per variant (median reported)"),
    out: str = typer.Option(None, help="also write the JSON here"),
) -> None:
    """Decode-step overhead in vLLM: repack vs naive vs none (no memory pressure), score collection on/off."""
    from vtoken.bench.overhead import overhead

    overhead(model, block_size, batch, prompt_len, gen_len, budget, repeats, out)
