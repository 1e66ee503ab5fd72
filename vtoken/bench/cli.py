"""``vtoken bench …``: benchmarks that print what they measured as JSON, with the command that produced it.

Speed and memory targets live here, compared side by side in one run, never as timed tests.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import typer

from vtoken.bench.longgen.cli import codegen_cmd, longgen_cmd, longgen_figure_cmd, trade_figure_cmd
from vtoken.bench.report import command_line, refuse
from vtoken.core.config import DEFAULT_SCORE_LAYERS
from vtoken.models.default import MODEL_HELP

BUDGET_HELP = "fraction of the context in (0, 1] or a token count (Budget.parse)"


bench_app = typer.Typer(help="Benchmarks (JSON out, with the command that produced it).", no_args_is_help=True)
bench_app.command("longgen")(longgen_cmd)
bench_app.command("longgen-figure")(longgen_figure_cmd)
bench_app.command("codegen")(codegen_cmd)
bench_app.command("trade-figure")(trade_figure_cmd)


@bench_app.command("sim-scale")
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
    from vtoken.bench.settings import configure
    from vtoken.bench.sim_scale import BASE, OWN, run_sim_scale
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


@bench_app.command("retained")
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

    from vtoken.bench.retained import BASE, OWN, grid, run_retained
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


@bench_app.command("overhead")
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
    from vtoken.bench.overhead import BASE, OWN, overhead
    from vtoken.bench.settings import configure
    from vtoken.errors import ConfigError
    from vtoken.vllm import engine_kwargs

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
    overhead(
        model, cfg, batch, prompt_len, gen_len, repeats, out, tensor_parallel_size, tuple(score_layers or ()), policies
    )


@bench_app.command("capacity")
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
    from vtoken.bench.capacity import BASE, MODES, OWN, CapacitySetup, main
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


@dataclass(frozen=True)
class QualityPreset:
    """What ``vtoken bench quality`` measures unless its flags say otherwise (``--quick`` or the full sweep)."""

    policies: str  # comma-separated policy names, or "all"
    budgets: str  # comma-separated fractions or token counts
    depths: str  # pass-key depths, comma-separated fractions
    per_depth: int  # pass-key prompts per depth
    windows: int  # language-modelling text windows
    window_tokens: int  # tokens per window
    ruler_tasks: str  # comma-separated RULER task names, "all" or "none"
    ruler_lengths: str  # comma-separated RULER lengths (tokens)
    ruler_samples: int  # RULER samples per task × length
    fidelity_prompts: int  # long-generation fidelity prompts (0 skips it)
    fidelity_tokens: int  # tokens each fidelity prompt generates


QUALITY_PRESETS = {
    "quick": QualityPreset(
        "h2o,tova,snapkv,streamingllm",
        "0.2,0.5",
        "0.2,0.5,0.8",
        per_depth=1,
        windows=2,
        window_tokens=256,
        ruler_tasks="niah_single_1",
        ruler_lengths="512",
        ruler_samples=8,
        fidelity_prompts=2,
        fidelity_tokens=64,
    ),
    "full": QualityPreset(
        "all",
        "0.1,0.2,0.3,0.4,0.5",
        "0.1,0.3,0.5,0.7,0.9",
        per_depth=2,
        windows=4,
        window_tokens=512,
        ruler_tasks="all",
        ruler_lengths="512,1024",
        ruler_samples=50,
        fidelity_prompts=20,
        fidelity_tokens=256,
    ),
}


@bench_app.command("prefix")
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
    from vtoken.vllm.launch import vllm_logs_to_stderr

    vllm_logs_to_stderr()
    from vtoken.bench.prefix import BASE, OWN, prefix
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
    prefix(model, cfg, chosen, requests, system_len, user_len, gen_len, repeats, seed, out)


def _count_setting(text: str, option: str, key: str) -> int:
    """One item of a comma-separated ``option`` (``--prompt-tails``, ``--score-pools``): a non-negative
    integer, checked as ``VTokenConfig``'s ``key`` (``ConfigError`` naming the option and the item)."""
    from vtoken.core.config import VTokenConfig
    from vtoken.errors import ConfigError

    try:
        n = int(text.strip())
    except ValueError:
        raise ConfigError(f"{option} {text.strip()!r}: give non-negative token counts") from None
    return getattr(VTokenConfig(**{key: n}), key)


def _score_layers(text: str) -> int | None:
    """``--score-layers`` item: ``all`` → None (every layer), else a count (``ConfigError`` naming it)."""
    from vtoken.core.config import VTokenConfig
    from vtoken.errors import ConfigError

    text = text.strip()
    if text == "all":
        return None
    try:
        n = int(text)
    except ValueError:
        raise ConfigError(f"--score-layers {text!r}: give 'all' or a positive layer count") from None
    return VTokenConfig(score_layers=n).score_layers


def _ruler_tasks(text: str) -> tuple[str, ...]:
    """'all' | 'none' | comma-separated RULER task names (ConfigError naming an unknown one)."""
    from vtoken.bench.ruler_tasks import TASKS
    from vtoken.errors import ConfigError

    if text.strip() == "none":
        return ()
    names = tuple(TASKS) if text.strip() == "all" else tuple(t.strip() for t in text.split(",") if t.strip())
    for name in names:
        if name not in TASKS:
            raise ConfigError(f"--tasks {name!r}: one of {', '.join(TASKS)}, 'all' or 'none'")
    return names


def _lengths(text: str) -> tuple[int, ...]:
    from vtoken.errors import ConfigError

    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"--lengths {text!r}: give comma-separated token counts") from None
    if not values or min(values) < 256:
        raise ConfigError(f"--lengths {text!r}: every length must be ≥ 256 tokens")
    return values


@bench_app.command("quality")
def quality_cmd(
    quick: bool = typer.Option(False, "--quick", help="a few points, a few minutes (else the full sweep)"),
    policies: str = typer.Option(None, help="comma-separated policy names, or 'all' (default: the preset's)"),
    budgets: str = typer.Option(None, help="comma-separated fractions or token counts (default: the preset's)"),
    granularities: str = typer.Option("token,block", help="token (repack) and/or block (whole blocks, naive)"),
    score_layers: str = typer.Option(
        str(DEFAULT_SCORE_LAYERS),
        "--score-layers",
        help="comma-separated: 'all' (every attention layer scores) and/or layer "
        "counts N (N layers, evenly spread, last included); each point per value "
        "(default: the engine's default score_layers)",
    ),
    prompt_tails: str = typer.Option(
        "0",
        "--prompt-tails",
        help="comma-separated prompt_tail values (the prompt's last tokens never evicted); each point per value",
    ),
    scopes: str = typer.Option(
        "all",
        help="comma-separated scopes: all and/or generated (decode-only eviction, "
        "the prompt kept whole); each point per value",
    ),
    prompt_scores: str = typer.Option(
        "all",
        "--prompt-scores",
        help="comma-separated: all and/or window (question-aware: H2O ranks the prompt "
        "by its last queries); each point per value",
    ),
    keep_masses: str = typer.Option(
        "none",
        "--keep-masses",
        help="comma-separated: none and/or fractions τ in (0, 1) (the adaptive budget: "
        "also evict while the rest holds τ of the attention mass); each point "
        "per value",
    ),
    score_pools: str = typer.Option(
        "0",
        "--score-pools",
        help="comma-separated score_pool values (span pooling: a token ranks by the "
        "heaviest score within that many positions; 0: off); each point per value",
    ),
    model: str = typer.Option("default", help="a trained model: default | smollm2 | gemma3-270m | PATH"),
    seed: int = typer.Option(0, help="draws other pass keys, needle positions and text windows"),
    context_tokens: int = typer.Option(400, "--context-tokens", help="filler tokens around the pass key"),
    chunk: int = typer.Option(64, help="prefill chunk of the language-modelling task (tokens)"),
    tasks: str = typer.Option(
        None, help="RULER-style tasks: comma-separated names, 'all' or 'none' (default: the preset's)"
    ),
    lengths: str = typer.Option(None, help="RULER lengths in tokens, comma-separated (default: the preset's)"),
    samples: int = typer.Option(None, min=1, help="RULER samples per task × length (default: the preset's)"),
    fidelity_prompts: int = typer.Option(
        None, "--fidelity-prompts", min=0, help="long-generation fidelity prompts, 0 skips it (default: the preset's)"
    ),
    fidelity_tokens: int = typer.Option(
        None, "--fidelity-tokens", min=1, help="tokens each fidelity prompt generates (default: the preset's)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print the JSON report only (always printed)"),
    plot: str = typer.Option(None, help="write the Pareto plot (PNG) here"),
    plot_ruler: str = typer.Option(
        None, "--plot-ruler", help="write the RULER rates with 95 % intervals and fidelity (PNG) here"
    ),
    out: str = typer.Option(None, help="also write the JSON here"),
    tensor_parallel_size: int = typer.Option(
        1, "--tensor-parallel-size", min=1, help="TP ranks (CPU: one process and core each)"
    ),
    sets: list[str] = typer.Option(
        [],
        "--set",
        help="vtoken.KEY=VALUE over the flags (repeatable): the engine's "
        "block_size, sinks, recent, or one value of a point's setting in every point",
    ),
) -> None:
    """Task quality (pass key, perplexity, RULER-style tasks with 95 % intervals, long-generation fidelity)
    per policy × granularity × budget vs retained blocks."""

    from rich.console import Console

    from vtoken.bench.quality import QualitySetup, apply_sets, points, run_quality
    from vtoken.bench.report import emit
    from vtoken.core.config import Budget, VTokenConfig
    from vtoken.errors import ConfigError
    from vtoken.policies import policy_names
    from vtoken.vllm.launch import vllm_logs_to_stderr

    vllm_logs_to_stderr()
    preset = QUALITY_PRESETS["quick" if quick else "full"]
    names = policies or preset.policies
    chosen = tuple(policy_names()) if names == "all" else tuple(p.strip() for p in names.split(",") if p.strip())
    grans = tuple(g.strip() for g in granularities.split(",") if g.strip())
    try:
        budget_values = tuple(Budget.parse(b.strip()).to_json() for b in (budgets or preset.budgets).split(","))
        layer_values = tuple(_score_layers(v) for v in score_layers.split(",") if v.strip())
        tail_values = tuple(
            _count_setting(v, "--prompt-tails", "prompt_tail") for v in prompt_tails.split(",") if v.strip()
        ) or (0,)
        scope_values = tuple(VTokenConfig(scope=v.strip()).scope.value for v in scopes.split(",") if v.strip())
        ps_values = tuple(
            VTokenConfig(prompt_scores=v.strip()).prompt_scores.value for v in prompt_scores.split(",") if v.strip()
        )
        mass_values = tuple(
            None if v.strip() == "none" else VTokenConfig(keep_mass=v.strip()).keep_mass
            for v in keep_masses.split(",")
            if v.strip()
        ) or (None,)
        pool_values = tuple(
            _count_setting(v, "--score-pools", "score_pool") for v in score_pools.split(",") if v.strip()
        ) or (0,)
        if chunk < 16 or context_tokens < 32:
            raise ConfigError(f"--chunk {chunk} / --context-tokens {context_tokens}: need ≥ 16 / ≥ 32")
        ruler_tasks = _ruler_tasks(tasks or preset.ruler_tasks)
        ruler_lengths = _lengths(lengths or preset.ruler_lengths)
        fid_prompts = preset.fidelity_prompts if fidelity_prompts is None else fidelity_prompts
        if plot_ruler and not (ruler_tasks or fid_prompts):
            raise ConfigError("--plot-ruler: nothing to plot with --tasks none and --fidelity-prompts 0")
        setup = QualitySetup(
            model=model,
            policies=chosen,
            budgets=budget_values,
            granularities=grans,
            depths=tuple(float(d) for d in preset.depths.split(",")),
            per_depth=preset.per_depth,
            context_tokens=context_tokens,
            windows=preset.windows,
            window_tokens=preset.window_tokens,
            chunk=chunk,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            score_layers=layer_values or (DEFAULT_SCORE_LAYERS,),
            prompt_tails=tail_values,
            scopes=scope_values or ("all",),
            prompt_scores=ps_values or ("all",),
            keep_masses=mass_values,
            score_pools=pool_values,
            ruler_tasks=ruler_tasks,
            ruler_lengths=ruler_lengths,
            ruler_samples=samples or preset.ruler_samples,
            fidelity_prompts=fid_prompts,
            fidelity_tokens=fidelity_tokens or preset.fidelity_tokens,
        )
        setup = apply_sets(setup, sets)
        for pt in points(setup):  # every point is one base config with its overrides: each checked here
            pt.config(setup.base())
        from vtoken.models.default import resolve_model

        setup = dataclasses.replace(setup, model=str(resolve_model(model)))
    except (ConfigError, ValueError, OSError) as err:
        refuse(err)
    console = Console(stderr=True)
    with console.status("quality benchmark", spinner="dots") as status:
        report = run_quality(setup, on_phase=lambda text: status.update(text))
    if plot:
        from vtoken.bench.quality_plot import plot_quality

        plot_quality(report, plot)
        report["plot"] = plot
    if plot_ruler:
        from vtoken.bench.yardstick_plot import plot_yardstick

        plot_yardstick(report, plot_ruler)
        report["plot_ruler"] = plot_ruler
    emit(report, out)


@bench_app.command("yardstick")
def yardstick_cmd(
    reports: list[str] = typer.Argument(..., help="`vtoken bench quality` JSON reports on one yardstick"),
    fidelity_from: str = typer.Option(
        "all", "--fidelity-from", help="comma-separated reports whose fidelity half counts, 'all' or 'none'"
    ),
    plot: str = typer.Option(None, help="write the yardstick figure (PNG) here"),
    table: bool = typer.Option(False, "--table", help="print the Markdown table instead of the JSON"),
    out: str = typer.Option(None, help="also write the merged JSON here"),
) -> None:
    """Every setting measured on the yardstick, from several quality runs: one merged report (JSON), its
    figure and its Markdown table."""
    import json
    from pathlib import Path

    from vtoken.bench.report import emit, partial_writer
    from vtoken.bench.yardstick_plot import merge_reports, parity_table, plot_yardstick, yardstick_table

    runs = []
    for name in reports:
        try:
            report = json.loads(Path(name).read_text())
        except (OSError, ValueError) as exc:
            refuse(f"report {name!r}: {exc}")
        if not isinstance(report, dict) or not {"ruler", "fidelity", "points", "full_cache"} <= report.keys():
            refuse(f"report {name!r} is no `vtoken bench quality` report")
        runs.append((name, report))
    chosen = {"all": list(reports), "none": []}.get(fidelity_from, [n for n in fidelity_from.split(",") if n])
    try:
        merged = merge_reports(runs, chosen)
    except ValueError as exc:
        refuse(exc)
    merged = {"command": command_line(), **merged}
    if plot:
        plot_yardstick(merged, plot)
        merged["plot"] = plot
    if table:  # the table on stdout; the JSON, as emit writes it, only to ``out``
        typer.echo(yardstick_table(merged) + "\n" + parity_table(merged), nl=False)
        partial_writer(out)(merged)
        return
    emit(merged, out)


@bench_app.command("score-host")
def score_host_cmd(
    policy: str = typer.Option("h2o", help="an attention policy (its first scored slot: vtoken.core.scored_range)"),
    generated: int = typer.Option(256, help="output tokens among each request's live tokens (the rest: prompt)"),
    repeats: int = typer.Option(5, help="timed repeats per row (the median is reported)"),
    seed: int = typer.Option(0),
    out: str = typer.Option(None, help="also write the JSON here"),
) -> None:
    """Host cost of one decode step's attention statistics (finish + fold), old path vs scored range."""
    from vtoken.bench.report import emit
    from vtoken.bench.score_host import SHAPES, run_score_host
    from vtoken.core.config import VTokenConfig
    from vtoken.errors import ConfigError

    try:
        VTokenConfig(policy=policy)
    except ConfigError as err:
        refuse(err)
    if repeats < 1 or not 0 < generated < min(live for _, live in SHAPES):
        refuse(f"--repeats {repeats} must be ≥ 1 and --generated {generated} in (0, {min(n for _, n in SHAPES)})")
    emit(run_score_host(policy, generated, repeats, seed, on_row=lambda r: typer.echo(f"{r}", err=True)), out)


@bench_app.command("kernels")
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
    from vtoken.bench.kernels import problems, run_kernels
    from vtoken.bench.report import emit
    from vtoken.kernels.check import DTYPES, Shape

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


@bench_app.command("fleet")
def fleet_cmd(
    replicas: int = typer.Option(256, help="replicas in the fleet (the autoscaler's max)"),
    loads: str = typer.Option("0.25,0.5,0.75,1,1.5,2", help="arrival rates × the naive fleet's capacity"),
    routers: str = typer.Option("kv,p2c,least_kv,round_robin", help="comma-separated router names"),
    modes: str = typer.Option("naive,repack", help="comma-separated reclamation modes: naive repack"),
    duration: float = typer.Option(40.0, help="simulated seconds of arrivals per run"),
    warmup: float = typer.Option(10.0, help="seconds of each run not measured"),
    pool_blocks: int = typer.Option(128, "--pool-blocks", help="KV pool of each replica (blocks)"),
    max_seqs: int = typer.Option(16, "--max-seqs", help="engine batch limit of each replica"),
    policy: str = typer.Option(None, help="eviction policy (default: fleet_model.BASE's)"),
    budget: str = typer.Option(None, help=BUDGET_HELP + " (default: fleet_model.BASE's)"),
    block_size: int = typer.Option(None, "--block-size", help="tokens per KV block (default: fleet_model.BASE's)"),
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
        None, help="seeds the routers, the simulation and the policy (default: fleet_model.BASE's)"
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

    from vtoken.bench.fleet import plot as draw
    from vtoken.bench.fleet import run_fleet, summary
    from vtoken.bench.fleet_model import BASE, MODES, OWN, ROUTERS
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


@bench_app.command("soak")
def soak_cmd(
    duration: float = typer.Option(120.0, min=10.0, help="seconds of load (minutes here, hours where you run it)"),
    concurrency: int = typer.Option(6, min=1, max=64, help="client threads"),
    seed: int = typer.Option(0, help="draws the requests (and their aborts)"),
    pool_blocks: int = typer.Option(64, "--pool-blocks", min=40, help="each replica's KV pool, in blocks"),
    kill_at: float = typer.Option(
        0.4, "--kill-at", min=0.0, max=0.9, help="share of the duration at which one replica is killed (0: none)"
    ),
    abort_rate: float = typer.Option(0.15, "--abort-rate", min=0.0, max=1.0, help="share of client aborts"),
    out: str = typer.Option(None, help="also write the JSON here"),
) -> None:
    """Chaos soak of the served stack (tiny model, 2 replicas on loopback): mixed requests, client aborts,
    pool pressure, a replica killed mid-run; exits 1 unless every request is accounted for, no KV
    invariant broke, nothing is held or left running and the greedy replay matches."""
    from vtoken.bench.report import emit
    from vtoken.bench.soak import SoakSetup, run_soak

    setup = SoakSetup(
        duration_s=duration,
        concurrency=concurrency,
        seed=seed,
        pool_blocks=pool_blocks,
        kill_at=kill_at,
        abort_rate=abort_rate,
    )
    report = run_soak(setup, on_phase=lambda text: typer.echo(f"[soak] {text}", err=True))
    emit(report, out)
    raise typer.Exit(0 if report["passed"] else 1)


@bench_app.command("serve")
def serve_cmd(
    model: str = typer.Option("default", help=MODEL_HELP),
    modes: str = typer.Option("none,naive,repack", help="comma-separated: none naive repack reuse+repack"),
    policies: str = typer.Option("h2o", help="comma-separated policies for the evicting modes"),
    budget: str = typer.Option(
        "0.2",
        help="fraction in (0, 1] or token count, over every token (scope all; "
        "--set vtoken.scope=generated: decode-only)",
    ),
    pool_blocks: int = typer.Option(64, "--pool-blocks", help="the replica's KV pool (blocks)"),
    max_num_seqs: int = typer.Option(16, "--max-num-seqs", help="engine batch limit"),
    rates: str = typer.Option("1.5", help="comma-separated request rates (req/s, Poisson)"),
    num_prompts: int = typer.Option(48, "--num-prompts", help="requests per run"),
    input_len: int = typer.Option(256, "--input-len"),
    output_len: int = typer.Option(96, "--output-len"),
    dataset: str = typer.Option("random", help="random | chat (shared system prompt, lengths ±50 %)"),
    prefix_len: int = typer.Option(128, "--prefix-len", help="chat: shared system-prompt tokens"),
    ttft_ms: float = typer.Option(15000, "--ttft-ms", help="TTFT SLO (ms), the same for every mode"),
    tpot_ms: float = typer.Option(300, "--tpot-ms", help="TPOT SLO (ms), the same for every mode"),
    seed: int = typer.Option(0, help="workload seed of the first repeat (repeat i: seed + i)"),
    burstiness: float = typer.Option(1.0, help="arrival burstiness: 1 Poisson, < 1 bursts (gamma intervals)"),
    range_ratio: float = typer.Option(
        0.0,
        "--range-ratio",
        help="random dataset: request lengths uniform in "
        "(1 ± this) × --input-len / --output-len (long and short mixed)",
    ),
    admission: str = typer.Option("off", help="SLO-aware admission per variant: off | on | off,on (an A/B)"),
    triggers: str = typer.Option(
        "step",
        help="eviction triggers per evicting variant, comma-separated: step (the fixed budget) | pressure "
        "(evict only when the pool is short; --budget is the floor)",
    ),
    stop_after_misses: int = typer.Option(
        0,
        "--stop-after-misses",
        help="stop a variant's sweep once this many rates in a row missed 90 % attainment (0: run every rate)",
    ),
    repeats: int = typer.Option(
        1,
        help="run every variant this many times in this one command; ratios per repeat, summarised as median (min-max)",
    ),
    sets: list[str] = typer.Option([], "--set", help="serve config key=value for every server (repeatable)"),
    as_json: bool = typer.Option(False, "--json", help="print the JSON only (progress otherwise on stderr)"),
    log: str = typer.Option(None, help="the servers' output goes here (default: discarded)"),
    out: str = typer.Option(None, help="also write the JSON here"),
    plot: str = typer.Option(None, help="write the attainment / goodput vs rate plot (PNG) here"),
) -> None:
    """The served path per mode: `vtoken serve` + `vllm bench serve`, goodput and SLO attainment per rate."""
    from vtoken.bench.report import emit, partial_writer
    from vtoken.bench.serve_bench import pool_shape_of, run_serve_bench, variant_config
    from vtoken.bench.serve_setup import DATASETS, ServeBenchSetup
    from vtoken.models.default import resolve_model
    from vtoken.vllm.launch import vllm_logs_to_stderr

    vllm_logs_to_stderr()  # the pool probe builds vLLM's engine config; servers and client log to --log
    try:
        rate_list = tuple(float(x) for x in rates.split(",") if x.strip())
    except ValueError:
        refuse(f"--rates {rates!r}: comma-separated numbers")
    checks = [
        (not rate_list or min(rate_list) <= 0, f"--rates {rates!r}: positive request rates"),
        (dataset not in DATASETS, f"--dataset {dataset!r}: valid are {', '.join(DATASETS)}"),
        (min(num_prompts, input_len, output_len) < 1, "--num-prompts, --input-len, --output-len must be ≥ 1"),
        (ttft_ms <= 0 or tpot_ms <= 0, "--ttft-ms / --tpot-ms must be > 0"),
        (stop_after_misses < 0, f"--stop-after-misses {stop_after_misses}: 0 (every rate) or a count ≥ 1"),
        (repeats < 1, f"--repeats {repeats}: need at least 1"),
        (burstiness <= 0, f"--burstiness {burstiness}: must be > 0"),
        (not 0 <= range_ratio < 1, f"--range-ratio {range_ratio}: must be in [0, 1)"),
        (range_ratio and dataset == "chat", f"--range-ratio {range_ratio}: chat sets its own (±50 %)"),
    ]
    switches = {"off": False, "on": True}
    trigger_list = tuple(t.strip() for t in triggers.split(",") if t.strip())
    checks.append(
        (
            not trigger_list or not set(trigger_list) <= {"step", "pressure"},
            f"--triggers {triggers!r}: valid are step, pressure",
        )
    )
    admission_list = [a.strip() for a in admission.split(",") if a.strip()]
    checks.append(
        (
            not admission_list or not set(admission_list) <= set(switches),
            f"--admission {admission!r}: valid are off, on, off,on",
        )
    )
    for failed, message in checks:
        if failed:
            refuse(message)
    setup = ServeBenchSetup(
        model=model,
        modes=tuple(m.strip() for m in modes.split(",") if m.strip()),
        policies=tuple(p.strip() for p in policies.split(",") if p.strip()),
        budget=budget,
        pool_blocks=pool_blocks,
        max_num_seqs=max_num_seqs,
        rates=rate_list,
        num_prompts=num_prompts,
        input_len=input_len,
        output_len=output_len,
        dataset=dataset,
        prefix_len=prefix_len,
        ttft_ms=ttft_ms,
        tpot_ms=tpot_ms,
        seed=seed,
        burstiness=burstiness,
        range_ratio=range_ratio,
        admission=tuple(switches[a] for a in admission_list),
        triggers=trigger_list,
        extra=tuple(sets),
        stop_after_misses=stop_after_misses,
        repeats=repeats,
    )
    if not setup.variants():
        refuse(f"--modes {modes!r} / --policies {policies!r}: nothing to run")
    try:  # the model's KV cache groups, as vLLM will build them for every server
        shape = pool_shape_of(setup, str(resolve_model(setup.model)))
    except ValueError as exc:
        refuse(str(exc))
    for v in setup.variants():  # every server's config is valid before the first one starts
        try:
            variant_config(setup, v.mode, v.policy, v.admission, shape=shape, trigger=v.trigger)
        except ValueError as exc:
            refuse(f"mode {v.mode!r}, policy {v.policy!r}, trigger {v.trigger!r}: {exc}")
    echo = (lambda *_: None) if as_json else (lambda line: typer.echo(line, err=True))
    try:
        report = run_serve_bench(setup, echo, log, checkpoint=partial_writer(out), shape=shape)
    except RuntimeError as exc:
        refuse(str(exc))
    if plot:
        from vtoken.bench.serve_plot import plot_serve

        plot_serve(report, plot)
    emit(report, out)
