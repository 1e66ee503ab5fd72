"""``vtoken bench …``: benchmarks that print what they measured as JSON, with the command that produced it.

Speed and memory targets live here, compared side by side in one run, never as timed tests.
"""

from __future__ import annotations

import typer

from vtoken.bench.report import refuse

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
    out: str = typer.Option(None, help="also write the JSON here"),
) -> None:
    """Retained KV blocks per mode for a grid of policies × budgets × block sizes (vs the paper's range)."""
    from vtoken.bench.retained import run_retained

    run_retained(policies, budgets, block_sizes, prompt_len, gen_len, requests, traces, sinks, recent, markdown,
                 out)


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
    from vtoken.core.config import VTokenConfig
    from vtoken.errors import ConfigError
    from vtoken.vllm import engine_kwargs

    try:
        engine_kwargs(VTokenConfig(policy="random", budget=budget, mode="repack", block_size=block_size))
    except (ConfigError, ValueError) as err:
        refuse(err)
    overhead(model, block_size, batch, prompt_len, gen_len, budget, repeats, out)


@bench_app.command("capacity")
def capacity_cmd(
    model: str = typer.Option("tiny-llama", help="default | tiny-llama | tiny-qwen2 | PATH"),
    policy: str = typer.Option("h2o"),
    budget: float = typer.Option(0.2, help="budget (fraction of the context, or a token count)"),
    block_size: int = typer.Option(32, "--block-size"),
    kv_blocks: int = typer.Option(64, "--kv-blocks", help="exact KV pool size in blocks (the memory limit)"),
    prompt_len: int = typer.Option(256, "--prompt-len"),
    gen_len: int = typer.Option(96, "--gen-len"),
    requests: int = typer.Option(32, help="burst size for the goodput run"),
    repeats: int = typer.Option(3, help="goodput runs per mode (median reported)"),
    ttft_slo: float = typer.Option(2.0, "--ttft-slo", help="seconds"),
    tpot_slo: float = typer.Option(0.1, "--tpot-slo", help="seconds per output token"),
    modes: str = typer.Option("naive,repack,reuse+repack", help="comma-separated reclamation modes"),
    out: str = typer.Option(None, help="also write the JSON here"),
) -> None:
    """Max feasible concurrency and burst SLA goodput per mode at a fixed KV pool (real vLLM engine)."""
    from vtoken.bench.capacity import MODES, CapacitySetup, main
    from vtoken.core.config import VTokenConfig
    from vtoken.errors import ConfigError

    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    bad = [m for m in chosen if m not in MODES]
    checks = [
        (not chosen or bad, f"--modes {modes!r}: valid modes are {', '.join(MODES)}"),
        (kv_blocks < 2, f"--kv-blocks {kv_blocks}: need at least 2"),
        (prompt_len < 1 or gen_len < 2, f"--prompt-len {prompt_len} / --gen-len {gen_len}: need ≥ 1 / ≥ 2"),
        (requests < 1, f"--requests {requests}: need at least 1"),
        (repeats < 1, f"--repeats {repeats}: need at least 1"),
        (ttft_slo <= 0 or tpot_slo <= 0, f"--ttft-slo {ttft_slo} / --tpot-slo {tpot_slo}: must be > 0"),
    ]
    for failed, message in checks:
        if failed:
            refuse(message)
    try:
        from vtoken.models.default import resolve_model
        from vtoken.vllm import engine_kwargs

        engine_kwargs(VTokenConfig(policy=policy, budget=budget, mode="repack", block_size=block_size))
        path = str(resolve_model(model))
    except (ConfigError, ValueError, OSError) as err:
        refuse(err)
    setup = CapacitySetup(model=path, policy=policy, budget=budget, block_size=block_size, kv_blocks=kv_blocks,
                          prompt_len=prompt_len, gen_len=gen_len)
    main(setup, chosen, requests, ttft_slo, tpot_slo, repeats, out)


QUALITY_PRESETS = {  # (policies, budgets, depths, per_depth, windows, window_tokens)
    "quick": ("h2o,tova,snapkv,streamingllm", "0.2,0.5", "0.2,0.5,0.8", 1, 2, 256),
    "full": ("all", "0.1,0.2,0.3,0.4,0.5", "0.1,0.3,0.5,0.7,0.9", 2, 4, 512),
}


@bench_app.command("prefix")
def prefix_cmd(
    model: str = typer.Option("tiny-llama", help="default | tiny-llama | tiny-qwen2 | PATH"),
    block_size: int = typer.Option(32, "--block-size"),
    modes: str = typer.Option("none,repack,reuse+repack", help="comma-separated modes, set per request"),
    policy: str = typer.Option("h2o"),
    budget: float = typer.Option(0.3, help="budget fraction"),
    requests: int = typer.Option(6, help="sequential requests sharing the system prompt"),
    system_len: int = typer.Option(256, "--system-len", help="shared system-prompt tokens"),
    user_len: int = typer.Option(64, "--user-len", help="each request's own prompt tokens"),
    gen_len: int = typer.Option(64, "--gen-len"),
    repeats: int = typer.Option(3, help="runs per mode, interleaved"),
    seed: int = typer.Option(0),
    out: str = typer.Option(None, help="also write the JSON here"),
) -> None:
    """Prefix-cache hits and TTFT of sequential requests sharing a system prompt, per mode (one engine)."""
    import os

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries only the report
    from vtoken.bench.prefix import prefix
    from vtoken.core.config import VTokenConfig
    from vtoken.errors import ConfigError
    from vtoken.vllm import engine_kwargs

    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    try:
        for m in chosen:
            VTokenConfig(policy=policy, budget=budget, mode=m, block_size=block_size)
        engine_kwargs(VTokenConfig(policy=policy, budget=budget, mode="repack", block_size=block_size))
    except (ConfigError, ValueError) as err:
        refuse(err)
    prefix(model, block_size, chosen, policy, budget, requests, system_len, user_len, gen_len, repeats, seed, out)


@bench_app.command("quality")
def quality_cmd(
    quick: bool = typer.Option(False, "--quick", help="a few points, a few minutes (else the full sweep)"),
    policies: str = typer.Option(None, help="comma-separated policy names, or 'all' (default: the preset's)"),
    budgets: str = typer.Option(None, help="comma-separated fractions or token counts (default: the preset's)"),
    granularities: str = typer.Option("token,block", help="token (repack) and/or block (whole blocks, naive)"),
    model: str = typer.Option("default", help="a trained model: default | smollm2 | PATH"),
    seed: int = typer.Option(0, help="draws other pass keys, needle positions and text windows"),
    context_tokens: int = typer.Option(400, "--context-tokens", help="filler tokens around the pass key"),
    chunk: int = typer.Option(64, help="prefill chunk of the language-modelling task (tokens)"),
    as_json: bool = typer.Option(False, "--json", help="print the JSON report only (always printed)"),
    plot: str = typer.Option(None, help="write the Pareto plot (PNG) here"),
    out: str = typer.Option(None, help="also write the JSON here"),
) -> None:
    """Task quality (pass-key accuracy, perplexity) per policy × granularity × budget vs retained blocks."""
    from rich.console import Console

    from vtoken.bench.quality import QualitySetup, run_quality
    from vtoken.bench.report import emit
    from vtoken.core.config import Budget, VTokenConfig
    from vtoken.errors import ConfigError
    from vtoken.policies import policy_names

    import os

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries only the report
    preset = QUALITY_PRESETS["quick" if quick else "full"]
    names = policies or preset[0]
    chosen = tuple(policy_names()) if names == "all" else tuple(p.strip() for p in names.split(",") if p.strip())
    grans = tuple(g.strip() for g in granularities.split(",") if g.strip())
    try:
        budget_values = tuple(Budget.parse(b.strip()).to_json() for b in (budgets or preset[1]).split(","))
        for p in chosen:
            for g in grans:
                VTokenConfig(policy=p, **({"granularity": g} if g != "token" else {}))
        if chunk < 16 or context_tokens < 32:
            raise ConfigError(f"--chunk {chunk} / --context-tokens {context_tokens}: need ≥ 16 / ≥ 32")
        from vtoken.models.default import resolve_model

        path = str(resolve_model(model))
    except (ConfigError, ValueError, OSError) as err:
        refuse(err)
    setup = QualitySetup(
        model=path, policies=chosen, budgets=budget_values, granularities=grans,
        depths=tuple(float(d) for d in preset[2].split(",")), per_depth=preset[3], context_tokens=context_tokens,
        windows=preset[4], window_tokens=preset[5], chunk=chunk, seed=seed,
    )
    console = Console(stderr=True)
    with console.status("quality benchmark", spinner="dots") as status:
        report = run_quality(setup, on_phase=lambda text: status.update(text))
    if plot:
        from vtoken.bench.quality_plot import plot_quality

        plot_quality(report, plot)
        report["plot"] = plot
    emit(report, out)


@bench_app.command("kernels")
def kernels_cmd(
    backend: str = typer.Option("triton", help="torch | triton"),
    device: str = typer.Option("cpu", help="cpu (Triton runs in its interpreter) | cuda (adds timings)"),
    layout: str = typer.Option("flash_attn", help="cpu | flash_attn | flashinfer | triton_attn | LBNHC | …"),
    layers: int = typer.Option(2),
    kv_heads: int = typer.Option(2, "--kv-heads"),
    q_heads: int = typer.Option(4, "--q-heads"),
    head_dim: int = typer.Option(64, "--head-dim"),
    block_size: int = typer.Option(16, "--block-size"),
    blocks: int = typer.Option(24),
    requests: int = typer.Option(4),
    seed: int = typer.Option(0),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16"),
    capacity: int = typer.Option(64, help="moves per fixed-shape launch (the Triton mover's padding)"),
    as_json: bool = typer.Option(False, "--json", help="print the JSON report only (always printed)"),
    out: str = typer.Option(None, help="also write the JSON here"),
) -> None:
    """A KV-move + score-collection backend vs the torch reference on one random step (timings on CUDA)."""
    from vtoken.bench.kernels import problems, run_kernels
    from vtoken.bench.report import emit
    from vtoken.kernels.check import DTYPES, Shape

    ints = {"--layers": layers, "--kv-heads": kv_heads, "--q-heads": q_heads, "--head-dim": head_dim,
            "--block-size": block_size, "--blocks": blocks, "--requests": requests, "--capacity": capacity}
    bad = problems(backend, device, layout, dtype, ints, q_heads, kv_heads)
    if bad:
        refuse("; ".join(bad))
    shape = Shape(layers, kv_heads, q_heads, head_dim, block_size, blocks, DTYPES[dtype])
    emit(run_kernels(backend, device, layout, shape, requests, seed, capacity), out)
