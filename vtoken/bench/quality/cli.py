"""``vtoken bench`` for what eviction costs in answers: quality, yardstick, longgen, codegen and their
figures. Mounted by ``vtoken/bench/cli.py``."""

from __future__ import annotations

import dataclasses

import typer

from vtoken.bench.quality.longgen.cli import codegen_cmd, longgen_cmd, longgen_figure_cmd, trade_figure_cmd
from vtoken.bench.quality.presets import (
    QUALITY_PRESETS,
    count_setting,
    ruler_lengths_of,
    ruler_tasks_of,
    score_layers_of,
)
from vtoken.bench.report import command_line, refuse
from vtoken.core.config import DEFAULT_SCORE_LAYERS

app = typer.Typer()
app.command("longgen")(longgen_cmd)
app.command("longgen-figure")(longgen_figure_cmd)
app.command("codegen")(codegen_cmd)
app.command("trade-figure")(trade_figure_cmd)


@app.command("quality")
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

    from vtoken.bench.quality.bench import QualitySetup, apply_sets, points, run_quality
    from vtoken.bench.report import emit
    from vtoken.core.config import Budget, VTokenConfig
    from vtoken.errors import ConfigError
    from vtoken.policies import policy_names
    from vtoken.vllm.offline.launch import vllm_logs_to_stderr

    vllm_logs_to_stderr()
    preset = QUALITY_PRESETS["quick" if quick else "full"]
    names = policies or preset.policies
    chosen = tuple(policy_names()) if names == "all" else tuple(p.strip() for p in names.split(",") if p.strip())
    grans = tuple(g.strip() for g in granularities.split(",") if g.strip())
    try:
        budget_values = tuple(Budget.parse(b.strip()).to_json() for b in (budgets or preset.budgets).split(","))
        layer_values = tuple(score_layers_of(v) for v in score_layers.split(",") if v.strip())
        tail_values = tuple(
            count_setting(v, "--prompt-tails", "prompt_tail") for v in prompt_tails.split(",") if v.strip()
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
            count_setting(v, "--score-pools", "score_pool") for v in score_pools.split(",") if v.strip()
        ) or (0,)
        if chunk < 16 or context_tokens < 32:
            raise ConfigError(f"--chunk {chunk} / --context-tokens {context_tokens}: need ≥ 16 / ≥ 32")
        ruler_tasks = ruler_tasks_of(tasks or preset.ruler_tasks)
        ruler_lengths = ruler_lengths_of(lengths or preset.ruler_lengths)
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
        from vtoken.bench.quality.plot import plot_quality

        plot_quality(report, plot)
        report["plot"] = plot
    if plot_ruler:
        from vtoken.bench.quality.yardstick_plot import plot_yardstick

        plot_yardstick(report, plot_ruler)
        report["plot_ruler"] = plot_ruler
    emit(report, out)


@app.command("yardstick")
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

    from vtoken.bench.quality.yardstick_plot import merge_reports, parity_table, plot_yardstick, yardstick_table
    from vtoken.bench.report import emit, partial_writer

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
