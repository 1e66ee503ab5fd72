"""``vtoken bench`` on one in-process engine or the engine-free core: sim-scale, retained, overhead, capacity,
prefix, score-host, kernels. Mounted by ``vtoken/bench/cli.py``."""

from __future__ import annotations

import dataclasses

import typer

from vtoken.bench.report import refuse
from vtoken.bench.settings import BUDGET_HELP
from vtoken.models.default import MODEL_HELP

app = typer.Typer()


@app.command("sim-scale")
def sim_scale(
    requests: int = typer.Option(10_000),
    prompt_len: int = typer.Option(8_064, "--prompt-len"),
    gen_len: int = typer.Option(128, "--gen-len"),
    policy: str = typer.Option(None, help="eviction policy (default: sim_scale.BASE's)"),
    budget: str = typer.Option(None, help=BUDGET_HELP + " (default: sim_scale.BASE's)"),
    block_size: int = typer.Option(None, "--block-size", help="tokens per KV block (default: sim_scale.BASE's)"),
    workers: int = typer.Option(1),
    out: str = typer.Option(None, help="also write the JSON here"),
    sets: list[str] = typer.Option(
        [],
        "--set",
        help="vtoken.KEY=VALUE: any setting of `vtoken settings`, over "
        "the flags (repeatable; not mode: every mode runs)",
    ),
) -> None:
    """The simulator at scale: R requests × (prompt + gen) tokens, every mode, wall time measured."""
    from vtoken.bench.engine.sim_scale import BASE, OWN, run_sim_scale
    from vtoken.bench.settings import configure
    from vtoken.errors import ConfigError
    from vtoken.sim.run import SimConfig

    try:
        cfg = SimConfig(
            vtoken=configure(BASE, sets, own=OWN, policy=policy, budget=budget, block_size=block_size),
            prompt_len=prompt_len,
            gen_len=gen_len,
            requests=requests,
            workers=workers,
        )
    except ConfigError as err:
        refuse(err)
    run_sim_scale(cfg, out)


@app.command("retained")
def retained(
    policies: str = typer.Option("h2o,scissorhands,random", help="comma-separated policy names"),
    budgets: str = typer.Option("0.2,0.5", help="comma-separated budgets"),
    block_sizes: str = typer.Option("16,32", "--block-sizes", help="comma-separated block sizes"),
    prompt_len: int = typer.Option(384, "--prompt-len"),
    gen_len: int = typer.Option(128, "--gen-len"),
    requests: int = typer.Option(64),
    traces: str = typer.Option(None, help=".npz of recorded attention; default synthetic"),
    sinks: int = typer.Option(None, help="first tokens never evicted (default: retained.BASE's)"),
    recent: int = typer.Option(None, help="last tokens never evicted (default: retained.BASE's)"),
    markdown: bool = typer.Option(False, help="also print a markdown table"),
    out: str = typer.Option(None, help="also write the JSON here"),
    sets: list[str] = typer.Option(
        [],
        "--set",
        help="vtoken.KEY=VALUE: any setting of `vtoken settings`, over "
        "the flags (repeatable; not mode, policy, budget or block_size: the grid's)",
    ),
) -> None:
    """Retained KV blocks per mode for a grid of policies × budgets × block sizes (vs the paper's range)."""
    from pathlib import Path

    from vtoken.bench.engine.retained import BASE, OWN, grid, run_retained
    from vtoken.bench.settings import configure
    from vtoken.errors import ConfigError
    from vtoken.sim.run import SimConfig

    try:
        base = SimConfig(
            vtoken=configure(BASE, sets, own=OWN, sinks=sinks, recent=recent),
            prompt_len=prompt_len,
            gen_len=gen_len,
            requests=requests,
            traces=Path(traces) if traces else None,
        )
        cells = grid(base, policies, budgets, block_sizes)
    except (ConfigError, ValueError) as err:
        refuse(err)
    run_retained(base, cells, markdown, out)


@app.command("overhead")
def overhead_cmd(
    model: str = typer.Option("tiny-llama", help=MODEL_HELP),
    block_size: int = typer.Option(None, "--block-size", help="tokens per KV block (default: overhead.BASE's)"),
    batch: int = typer.Option(8, help="concurrent requests"),
    prompt_len: int = typer.Option(256, "--prompt-len"),
    gen_len: int = typer.Option(64, "--gen-len"),
    budget: str = typer.Option(None, help=BUDGET_HELP + " for the evicting variants (default: overhead.BASE's)"),
    repeats: int = typer.Option(3, help="runs per variant (median reported)"),
    out: str = typer.Option(None, help="also write the JSON here"),
    tensor_parallel_size: int = typer.Option(
        1, "--tensor-parallel-size", min=1, help="TP ranks (CPU: one process and core each)"
    ),
    score_layers: list[int] = typer.Option(
        None,
        "--score-layers",
        help="also measure repack+scores@N: only N attention layers score "
        "(repeatable; repack+scores is the default score_layers, "
        "repack+scores@all every layer, both always run)",
    ),
    policy: list[str] = typer.Option(
        None,
        "--policy",
        help="the evicting variants' policy (default: overhead.BASE's, random); "
        "an attention policy makes every variant score (naive and repack "
        "paired, no score-collection rows); repeatable with attention "
        "policies: each runs every evicting variant in the same run",
    ),
    sets: list[str] = typer.Option(
        [],
        "--set",
        help="vtoken.KEY=VALUE: any setting of `vtoken settings`, over "
        "the flags (repeatable; not mode, policy or score_layers: each variant's)",
    ),
) -> None:
    """Decode-step overhead in vLLM: repack vs naive vs none (no memory pressure), score collection on/off."""
    from vtoken.bench.engine.overhead import BASE, OWN, run_overhead
    from vtoken.bench.report import emit
    from vtoken.bench.settings import configure
    from vtoken.errors import ConfigError
    from vtoken.vllm import engine_kwargs
    from vtoken.vllm.offline.launch import vllm_logs_to_stderr

    policies = tuple(dict.fromkeys(policy or [BASE.policy]))
    try:
        cfg = configure(BASE, sets, own=OWN, policy=policies[0], budget=budget, block_size=block_size)
        cfgs = [dataclasses.replace(cfg, policy=p) for p in policies]
        engine_kwargs(cfgs[0])
        for n in score_layers or ():
            dataclasses.replace(cfg, score_layers=n)
    except (ConfigError, ValueError) as err:
        refuse(err)
    if score_layers and cfgs[0].policy_class.needs_attention():
        refuse(
            f"--score-layers with --policy {policies[0]!r}: score collection is measured with a query-free "
            f"policy (with {policies[0]!r} every variant scores)"
        )
    if len(policies) > 1 and (plain := [c.policy for c in cfgs if not c.policy_class.needs_attention()]):
        refuse(
            f"--policy {plain[0]!r} with other policies: several policies are compared only among attention "
            f"policies (run a query-free policy on its own)"
        )
    vllm_logs_to_stderr()
    layers = tuple(score_layers or ())
    emit(run_overhead(model, cfg, batch, prompt_len, gen_len, repeats, tensor_parallel_size, layers, policies), out)


@app.command("capacity")
def capacity_cmd(
    model: str = typer.Option("tiny-llama", help=MODEL_HELP),
    policy: str = typer.Option(None, help="eviction policy (default: capacity.BASE's)"),
    budget: str = typer.Option(None, help=BUDGET_HELP + " (default: capacity.BASE's)"),
    block_size: int = typer.Option(None, "--block-size", help="tokens per KV block (default: capacity.BASE's)"),
    kv_blocks: int = typer.Option(64, "--kv-blocks", help="exact KV pool size in blocks (the memory limit)"),
    prompt_len: int = typer.Option(256, "--prompt-len"),
    gen_len: int = typer.Option(96, "--gen-len"),
    requests: int = typer.Option(32, help="burst size for the goodput run"),
    repeats: int = typer.Option(3, help="goodput runs per mode (median reported)"),
    ttft_slo: float = typer.Option(2.0, "--ttft-slo", help="seconds"),
    tpot_slo: float = typer.Option(0.1, "--tpot-slo", help="seconds per output token"),
    modes: str = typer.Option("naive,repack,reuse+repack", help="comma-separated reclamation modes"),
    out: str = typer.Option(None, help="also write the JSON here"),
    tensor_parallel_size: int = typer.Option(
        1, "--tensor-parallel-size", min=1, help="TP ranks (CPU: one process and core each)"
    ),
    sets: list[str] = typer.Option(
        [],
        "--set",
        help="vtoken.KEY=VALUE: any setting of `vtoken settings`, over the flags (repeatable; not mode: --modes)",
    ),
) -> None:
    """Max feasible concurrency and burst SLA goodput per mode at a fixed KV pool (real vLLM engine)."""
    from vtoken.bench.engine.capacity import BASE, MODES, OWN, CapacitySetup, main
    from vtoken.bench.settings import configure
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

        cfg = configure(BASE, sets, own=OWN, policy=policy, budget=budget, block_size=block_size)
        engine_kwargs(cfg)
        path = str(resolve_model(model))
    except (ConfigError, ValueError, OSError) as err:
        refuse(err)
    setup = CapacitySetup(
        model=path,
        kv_blocks=kv_blocks,
        prompt_len=prompt_len,
        gen_len=gen_len,
        vtoken=cfg,
        tensor_parallel_size=tensor_parallel_size,
    )
    main(setup, chosen, requests, ttft_slo, tpot_slo, repeats, out)


@app.command("prefix")
def prefix_cmd(
    model: str = typer.Option("tiny-llama", help=MODEL_HELP),
    block_size: int = typer.Option(None, "--block-size", help="tokens per KV block (default: prefix.BASE's)"),
    modes: str = typer.Option("none,repack,reuse+repack", help="comma-separated modes, set per request"),
    policy: str = typer.Option(None, help="eviction policy (default: prefix.BASE's)"),
    budget: str = typer.Option(None, help=BUDGET_HELP + " (default: prefix.BASE's)"),
    requests: int = typer.Option(6, help="sequential requests sharing the system prompt"),
    system_len: int = typer.Option(256, "--system-len", help="shared system-prompt tokens"),
    user_len: int = typer.Option(64, "--user-len", help="each request's own prompt tokens"),
    gen_len: int = typer.Option(64, "--gen-len"),
    repeats: int = typer.Option(3, help="runs per mode, interleaved"),
    seed: int = typer.Option(0),
    out: str = typer.Option(None, help="also write the JSON here"),
    sets: list[str] = typer.Option(
        [],
        "--set",
        help="vtoken.KEY=VALUE: any setting of `vtoken settings`, over the flags (repeatable; not mode: --modes)",
    ),
) -> None:
    """Prefix-cache hits and TTFT of sequential requests sharing a system prompt, per mode (one engine)."""
    from vtoken.vllm.offline.launch import vllm_logs_to_stderr

    vllm_logs_to_stderr()
    from vtoken.bench.engine.prefix import BASE, OWN, run_prefix
    from vtoken.bench.report import emit
    from vtoken.bench.settings import configure
    from vtoken.errors import ConfigError
    from vtoken.vllm import engine_kwargs

    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    try:
        cfg = configure(BASE, sets, own=OWN, policy=policy, budget=budget, block_size=block_size)
        for m in chosen:
            dataclasses.replace(cfg, mode=m)
        engine_kwargs(cfg)
    except (ConfigError, ValueError) as err:
        refuse(err)
    emit(run_prefix(model, cfg, chosen, requests, system_len, user_len, gen_len, repeats, seed), out)


@app.command("score-host")
def score_host_cmd(
    policy: str = typer.Option("h2o", help="an attention policy (its first scored slot: vtoken.core.scored_range)"),
    generated: int = typer.Option(256, help="output tokens among each request's live tokens (the rest: prompt)"),
    repeats: int = typer.Option(5, help="timed repeats per row (the median is reported)"),
    seed: int = typer.Option(0),
    out: str = typer.Option(None, help="also write the JSON here"),
) -> None:
    """Host cost of one decode step's attention statistics (finish + fold), old path vs scored range."""
    from vtoken.bench.engine.score_host import SHAPES, run_score_host
    from vtoken.bench.report import emit
    from vtoken.core.config import VTokenConfig
    from vtoken.errors import ConfigError

    try:
        VTokenConfig(policy=policy)
    except ConfigError as err:
        refuse(err)
    if repeats < 1 or not 0 < generated < min(live for _, live in SHAPES):
        refuse(f"--repeats {repeats} must be ≥ 1 and --generated {generated} in (0, {min(n for _, n in SHAPES)})")
    emit(run_score_host(policy, generated, repeats, seed, on_row=lambda r: typer.echo(f"{r}", err=True)), out)


@app.command("kernels")
def kernels_cmd(
    backend: str = typer.Option("triton", help="torch | triton"),
    device: str = typer.Option("cpu", help="cpu (Triton runs in its interpreter) | cuda (adds timings)"),
    layout: str = typer.Option("flash_attn", help="cpu | flash_attn | flashinfer | triton_attn | LBNHC | LHBNC | …"),
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
    from vtoken.bench.engine.kernels import problems, run_kernels
    from vtoken.bench.report import emit
    from vtoken.kernels.backend_check import DTYPES, Shape

    ints = {
        "--layers": layers,
        "--kv-heads": kv_heads,
        "--q-heads": q_heads,
        "--head-dim": head_dim,
        "--block-size": block_size,
        "--blocks": blocks,
        "--requests": requests,
        "--capacity": capacity,
    }
    bad = problems(backend, device, layout, dtype, ints, q_heads, kv_heads)
    if bad:
        refuse("; ".join(bad))
    shape = Shape(layers, kv_heads, q_heads, head_dim, block_size, blocks, DTYPES[dtype])
    emit(run_kernels(backend, device, layout, shape, requests, seed, capacity), out)
